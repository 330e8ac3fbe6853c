"""Prometheus metrics of the hierarchical cache (see ``metrics.py`` for the list): registered when
the first engine with a host tier attaches, updated once per step from ``Counters`` and the tree."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily

from services.scheduler.counters import Counters
from services.scheduler.hicache import HiCache

WAIT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
HIT_RATE_HELP = "Prompt tokens served from the prefix cache / prompt tokens, since start"


class HitRate:
    """``banyan:cache_hit_rate``: one unlabelled value, or with tiers one per ``tier`` label (``all``
    being the same value)."""

    def __init__(self) -> None:
        self.value = 0.0
        self.tiers: dict[str, float] | None = None

    def collect(self):
        if self.tiers is None:
            yield GaugeMetricFamily("banyan:cache_hit_rate", HIT_RATE_HELP, value=self.value)
            return
        g = GaugeMetricFamily("banyan:cache_hit_rate", HIT_RATE_HELP, labels=["tier"])
        g.add_metric(["all"], self.value)
        for tier, v in self.tiers.items():
            g.add_metric([tier], v)
        yield g


class TierMetrics:
    def __init__(self, r: CollectorRegistry) -> None:
        self.hits = Counter("banyan:hicache_hit_tokens", "Prompt tokens whose KV came back from a lower tier",
                            ["tier"], registry=r)
        self.used = Gauge("banyan:hicache_used_bytes", "Bytes of KV held by a lower tier (per worker rank)",
                          ["tier"], registry=r)
        self.capacity = Gauge("banyan:hicache_capacity_bytes", "Bytes a lower tier may hold (per worker rank)",
                              ["tier"], registry=r)
        self.moved = Counter("banyan:hicache_moved_bytes", "KV bytes copied between tiers (per worker rank)",
                             ["direction"], registry=r)
        self.seconds = Counter("banyan:hicache_copy_seconds", "Time the tier copies took (the worker's clock)",
                               ["direction"], registry=r)
        self.demoted = Counter("banyan:hicache_demoted_tokens", "Tokens the pool evicted with a copy to the host "
                               "on their way out (the next forward waits for it)", registry=r)
        self.failures = Counter("banyan:hicache_failures", "Tier copies that failed (the tokens are recomputed)",
                                ["kind"], registry=r)
        self.fetch_wait = Histogram("banyan:hicache_fetch_wait_seconds", "Time a request was kept aside while its "
                                    "cached prefix came back into the KV pool", buckets=WAIT_BUCKETS, registry=r)
        self._seen: dict = {}

    def _inc(self, metric: Counter, label: str | None, total: float) -> None:
        key = (id(metric), label)
        last = self._seen.get(key, 0)
        if total > last:
            (metric if label is None else metric.labels(label)).inc(total - last)
            self._seen[key] = total

    def update(self, c: Counters, h: HiCache) -> None:
        t = h.tree
        bpt = t.bytes_per_token
        self._inc(self.hits, "host", c.host_hit_tokens)
        self._inc(self.hits, "disk", c.disk_hit_tokens)
        self.used.labels("host").set(t.host_used * bpt)
        self.capacity.labels("host").set(t.host.pool_size * bpt)
        if t.disk_capacity:
            self.used.labels("disk").set(t.disk_used)
            self.capacity.labels("disk").set(t.disk_capacity)
        for d, n in c.tier_tokens.items():
            self._inc(self.moved, d, n * bpt)
        for d, s in c.tier_seconds.items():
            self._inc(self.seconds, d, s)
        self._inc(self.demoted, None, c.demoted_tokens)
        for k, n in c.tier_failures.items():
            self._inc(self.failures, k, n)
        for w in h.fetch_waits:
            self.fetch_wait.observe(w)
        h.fetch_waits.clear()

    @staticmethod
    def hit_rates(c: Counters) -> dict[str, float]:
        if not c.prompt:
            return {"device": 0.0, "host": 0.0, "disk": 0.0}
        lower = c.host_hit_tokens + c.disk_hit_tokens
        return {"device": max(0, c.prefill_cached - lower) / c.prompt, "host": c.host_hit_tokens / c.prompt,
                "disk": c.disk_hit_tokens / c.prompt}
