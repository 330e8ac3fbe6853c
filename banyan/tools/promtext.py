"""Prometheus text → samples, and the arithmetic ``banyan top`` does on them: sums over label
sets, counter deltas between two scrapes, histogram quantiles from cumulative buckets (as
PromQL's ``histogram_quantile``: linear within the bucket holding the rank)."""

from __future__ import annotations

import math
import urllib.request
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


@dataclass
class Scrape:
    """One endpoint's samples at one time (``error`` set when it could not be read)."""

    url: str
    t: float
    samples: list[Sample] = field(default_factory=list)
    error: str = ""

    def has(self, name: str) -> bool:
        return any(s.name == name for s in self.samples)

    def total(self, name: str, **labels: str) -> float | None:
        """The sum of ``name``'s samples whose labels include ``labels``; None when it has none."""
        vals = [s.value for s in self.samples if s.name == name and _match(s.labels, labels)]
        return sum(vals) if vals else None

    def by_label(self, name: str, label: str) -> dict[str, float]:
        """``name`` summed per value of ``label`` (samples without it are left out)."""
        out: dict[str, float] = {}
        for s in self.samples:
            if s.name == name and label in s.labels:
                out[s.labels[label]] = out.get(s.labels[label], 0.0) + s.value
        return out

    def buckets(self, base: str) -> list[tuple[float, float]]:
        """A histogram's cumulative buckets [(upper bound, count)], summed over its other labels."""
        acc: dict[float, float] = {}
        for s in self.samples:
            if s.name == base + "_bucket" and "le" in s.labels:
                le = float(s.labels["le"])
                acc[le] = acc.get(le, 0.0) + s.value
        return sorted(acc.items())


def _match(have: dict[str, str], want: dict[str, str]) -> bool:
    return all(have.get(k) == v for k, v in want.items())


def parse(text: str) -> list[Sample]:
    return [Sample(s.name, dict(s.labels), float(s.value))
            for fam in text_string_to_metric_families(text) for s in fam.samples]


def scrape(url: str, now: float, timeout: float = 5.0) -> Scrape:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return Scrape(url, now, parse(r.read().decode("utf-8", "replace")))
    except Exception as e:  # noqa: BLE001 — any failure is shown on its row, the view goes on
        return Scrape(url, now, error=str(getattr(e, "reason", e)) or type(e).__name__)


def delta_buckets(cur: list[tuple[float, float]], prev: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The observations between two scrapes (a counter reset — the process restarted — gives ``cur``)."""
    before = dict(prev)
    out = [(le, n - before.get(le, 0.0)) for le, n in cur]
    return cur if any(n < 0 for _, n in out) else out


def quantile(buckets: list[tuple[float, float]], q: float) -> float | None:
    """The q-quantile of cumulative ``buckets`` (None without observations). A rank in the +Inf
    bucket gives the highest finite bound, as Prometheus does."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    total = buckets[-1][1]
    rank = q * total
    lower_le, lower_n = 0.0, 0.0
    for le, n in buckets:
        if n >= rank:
            if math.isinf(le):
                return lower_le
            if n == lower_n:
                return le
            return lower_le + (le - lower_le) * (rank - lower_n) / (n - lower_n)
        lower_le, lower_n = le, n
    return lower_le


def rate(cur: float | None, prev: float | None, seconds: float) -> float | None:
    """Per-second increase of a counter (None when unknown; a reset counts from 0)."""
    if cur is None or prev is None or seconds <= 0:
        return None
    return (cur - prev if cur >= prev else cur) / seconds
