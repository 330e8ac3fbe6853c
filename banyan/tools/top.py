"""``banyan top``: a live terminal view of a running deployment, from its Prometheus endpoints.

Endpoints come from ``banyan serve``'s ready file (``--ready-file``: gRPC port, HTTP port — the
tokenizers' ``/metrics`` —, then the scheduler's and the worker's metrics ports, and with
``--dp`` every group's) or are given as URLs, each recognised by what it serves. Every
``--interval`` seconds all of them are scraped; rates and latency percentiles come from the
difference between the last two scrapes (the window), next to the values since start.
``--once`` prints one snapshot (two scrapes ``--interval`` apart) and exits: 0, or 1 when an
endpoint could not be read; ``--json`` prints it as JSON.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass

from banyan.tools.promtext import Scrape, delta_buckets, quantile, rate, scrape

from shared.entry import Parser

QUANTILES = (0.5, 0.9, 0.99)
TTFT, ITL, E2E = ("banyan:time_to_first_token_seconds", "banyan:inter_token_latency_seconds",
                  "banyan:e2e_request_latency_seconds")
ROLE_MARKS = {"tokenizer": TTFT, "scheduler": "banyan:num_running_requests", "worker": "banyan:forward_time_seconds"}


@dataclass
class Endpoints:
    tokenizer: str = ""
    schedulers: tuple[str, ...] = ()  # group g's at [g]
    workers: tuple[str, ...] = ()

    def urls(self) -> list[str]:
        return [u for u in (self.tokenizer, *self.schedulers, *self.workers) if u]


def _url(host: str, port: str) -> str:
    return f"http://{host}:{port}/metrics" if port.strip() not in ("", "0", "-1") else ""


def from_ready_file(path: str, host: str = "127.0.0.1") -> Endpoints:
    """gRPC port, HTTP port (-1: none), scheduler and worker metrics ports of group 0 (0: none),
    then with --dp > 1 every group's, comma-separated."""
    with open(path) as f:
        lines = f.read().split()
    if len(lines) < 2:
        raise ValueError(f"{path} is not a banyan serve ready file (it has {len(lines)} lines)")
    sched = lines[4].split(",") if len(lines) > 5 else lines[2:3]
    work = lines[5].split(",") if len(lines) > 5 else lines[3:4]
    return Endpoints(_url(host, lines[1]), tuple(_url(host, p) for p in sched), tuple(_url(host, p) for p in work))


def _normalise(url: str) -> str:
    if "://" not in url:
        url = "http://" + url
    return url if url.rstrip("/").endswith("/metrics") else url.rstrip("/") + "/metrics"


def from_urls(urls: list[str]) -> Endpoints:
    """Each URL's role from the metrics it serves; schedulers and workers numbered in the order given."""
    roles: dict[str, list[str]] = {"tokenizer": [], "scheduler": [], "worker": []}
    for url in map(_normalise, urls):
        s = scrape(url, time.time())
        if s.error:
            raise ValueError(f"{url}: {s.error}")
        role = next((r for r, mark in ROLE_MARKS.items() if s.has(mark) or s.has(mark + "_count")), None)
        if role is None:
            raise ValueError(f"{url} serves no Banyan metrics (a tokenizer's, a scheduler's or a worker's)")
        roles[role].append(url)
    if len(roles["tokenizer"]) > 1:
        raise ValueError(f"more than one tokenizer endpoint: {roles['tokenizer']} (a scrape of one sums all replicas)")
    return Endpoints(next(iter(roles["tokenizer"]), ""), tuple(roles["scheduler"]), tuple(roles["worker"]))


def _ms(x: float | None) -> float | None:
    return None if x is None else x * 1e3


def _latency(cur: Scrape, prev: Scrape | None, name: str) -> dict:
    total = cur.buckets(name)
    window = delta_buckets(total, prev.buckets(name)) if prev is not None and not prev.error else []
    return {"window": {f"p{round(q * 100)}": _ms(quantile(window, q)) for q in QUANTILES},
            "since_start": {f"p{round(q * 100)}": _ms(quantile(total, q)) for q in QUANTILES}}


def _ratio(num: float | None, den: float | None) -> float | None:
    return None if num is None or not den else num / den


def tokenizer_view(cur: Scrape, prev: Scrape | None) -> dict:
    if cur.error:
        return {"url": cur.url, "error": cur.error}
    dt = cur.t - prev.t if prev is not None and not prev.error else 0.0
    p = prev if dt else None

    def r(name: str, **labels: str) -> float | None:
        return rate(cur.total(name, **labels), p.total(name, **labels), dt) if p else None

    status = cur.by_label("banyan_http_requests_total", "status")
    return {
        "url": cur.url,
        "requests_per_s": r("banyan:request_success_total"),
        "tokens_in_per_s": r("banyan:prompt_tokens_total"), "tokens_out_per_s": r("banyan:generation_tokens_total"),
        "cache_hit_rate": {"window": _ratio(r("banyan:cached_tokens_total"), r("banyan:prompt_tokens_total")),
                           "since_start": _ratio(cur.total("banyan:cached_tokens_total"),
                                                 cur.total("banyan:prompt_tokens_total"))},
        "http_in_flight": sum(n for ep, n in cur.by_label("banyan_http_requests_in_flight", "endpoint").items()
                              if ep != "/metrics"),  # (not this scrape)
        "ttft_ms": _latency(cur, p, TTFT), "itl_ms": _latency(cur, p, ITL), "e2e_ms": _latency(cur, p, E2E),
        "finished": cur.by_label("banyan:request_success_total", "finish_reason"),
        "errors": {"since_start": cur.total("banyan:request_success_total", finish_reason="error"),
                   "window": r("banyan:request_success_total", finish_reason="error"),
                   "http_5xx": sum(v for s, v in status.items() if s.startswith("5"))},
    }


def group_view(g: int, sched: Scrape | None, prev_s: Scrape | None, work: Scrape | None,
               prev_w: Scrape | None) -> dict:
    out: dict = {"group": g, "errors": []}
    if sched is not None:
        out["scheduler"] = sched.url
        if sched.error:
            out["errors"].append(f"scheduler {sched.url}: {sched.error}")
        else:
            tiers = sched.by_label("banyan:cache_hit_rate", "tier")  # per cache tier, when the cache has tiers
            p = prev_s if prev_s is not None and not prev_s.error else None
            out.update(running=sched.total("banyan:num_running_requests"),
                       waiting=sched.total("banyan:num_waiting_requests"),
                       kv_usage=sched.total("banyan:kv_cache_usage"),
                       kv_evictable_tokens=sched.total("banyan:kv_cache_evictable_tokens"),
                       cache_hit_rate=tiers or {"all": sched.total("banyan:cache_hit_rate")},
                       retractions=sched.total("banyan:retractions_total"),
                       queue_ms=_latency(sched, p, "banyan:queue_time_seconds"))
    if work is not None:
        out["worker"] = work.url
        if work.error:
            out["errors"].append(f"worker {work.url}: {work.error}")
        else:
            p = prev_w if prev_w is not None and not prev_w.error else None
            dt = work.t - p.t if p else 0.0
            steps = rate(work.total("banyan:forward_batch_size_count"), p.total("banyan:forward_batch_size_count"),
                         dt) if p else None
            rows = rate(work.total("banyan:forward_batch_size_sum"), p.total("banyan:forward_batch_size_sum"),
                        dt) if p else None
            out.update(computed_tokens_per_s=rate(work.total("banyan:forward_tokens_total"),
                                                  p.total("banyan:forward_tokens_total"), dt) if p else None,
                       steps_per_s=steps, batch_size_mean=_ratio(rows, steps),
                       step_ms=_latency(work, p, "banyan:forward_time_seconds"),
                       forward_failures=work.total("banyan:forward_failures_total"))
    return out


class Top:
    def __init__(self, endpoints: Endpoints) -> None:
        self.ep = endpoints
        self.prev: dict[str, Scrape] = {}
        self.cur: dict[str, Scrape] = {}

    def poll(self) -> None:
        now = time.time()
        self.prev, self.cur = self.cur, {u: scrape(u, now) for u in self.ep.urls()}

    def view(self) -> dict:
        cur, prev = self.cur, self.prev
        groups = max(len(self.ep.schedulers), len(self.ep.workers))
        pick = (lambda urls, g, d: d.get(urls[g]) if g < len(urls) and urls[g] else None)
        some = next(iter(cur.values()), None)
        return {
            "time": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(some.t if some else time.time())),
            "window_s": (some.t - prev[some.url].t) if some and some.url in prev else None,
            "tokenizer": tokenizer_view(cur[self.ep.tokenizer], prev.get(self.ep.tokenizer))
            if self.ep.tokenizer else None,
            "groups": [group_view(g, pick(self.ep.schedulers, g, cur), pick(self.ep.schedulers, g, prev),
                                  pick(self.ep.workers, g, cur), pick(self.ep.workers, g, prev))
                       for g in range(groups)],
        }


def _f(x: float | None, fmt: str = "{:.1f}", none: str = "-") -> str:
    return none if x is None else fmt.format(x)


def _pct(x: float | None) -> str:
    return _f(None if x is None else 100 * x, "{:.1f}%")


def _lat(d: dict) -> str:
    w, s = d["window"], d["since_start"]
    return (" ".join(f"{k} {_f(v)}" for k, v in w.items()) + "   (since start: "
            + " ".join(f"{k} {_f(v)}" for k, v in s.items()) + ")")


def render(v: dict) -> str:
    window = f"window {v['window_s']:.1f} s" if v["window_s"] else "since start"
    lines = [f"banyan top   {v['time']}   rates over the {window}"]
    t = v["tokenizer"]
    if t is None:
        lines.append("tokenizers: no endpoint (no HTTP port)")
    elif "error" in t:
        lines.append(f"tokenizers {t['url']}: UNREACHABLE ({t['error']})")
    else:
        hit = t["cache_hit_rate"]
        err = t["errors"]
        lines += [
            f"tokenizers {t['url']}",
            f"  requests/s {_f(t['requests_per_s'], '{:.2f}')}   HTTP in flight {_f(t['http_in_flight'], '{:.0f}')}"
            f"   tokens/s in {_f(t['tokens_in_per_s'])}  out {_f(t['tokens_out_per_s'])}"
            f"   cache hit {_pct(hit['window'])} (since start {_pct(hit['since_start'])})",
            f"  TTFT ms  {_lat(t['ttft_ms'])}",
            f"  ITL ms   {_lat(t['itl_ms'])}",
            f"  E2E ms   {_lat(t['e2e_ms'])}",
            f"  errors   {_f(err['since_start'], '{:.0f}')} since start ({_f(err['window'], '{:.2f}')}/s now), "
            f"HTTP 5xx {err['http_5xx']:.0f}   finished: "
            + ", ".join(f"{k} {n:.0f}" for k, n in sorted(t["finished"].items())),
        ]
    head = ("group", "running", "waiting", "KV used", "evictable", "cache hit", "queue p50 ms", "computed tok/s",
            "step p50/p99 ms", "batch", "retracted", "failed")
    rows = []
    for g in v["groups"]:
        hit = g.get("cache_hit_rate") or {}
        hits = " ".join(_pct(x) if k == "all" else f"{k} {_pct(x)}" for k, x in sorted(hit.items())) or "-"
        step = (g.get("step_ms") or {}).get("window", {})
        rows.append((str(g["group"]), _f(g.get("running"), "{:.0f}"), _f(g.get("waiting"), "{:.0f}"),
                     _pct(g.get("kv_usage")), _f(g.get("kv_evictable_tokens"), "{:.0f}"), hits,
                     _f(((g.get("queue_ms") or {}).get("window") or {}).get("p50")),
                     _f(g.get("computed_tokens_per_s")), f"{_f(step.get('p50'))}/{_f(step.get('p99'))}",
                     _f(g.get("batch_size_mean")), _f(g.get("retractions"), "{:.0f}"),
                     _f(g.get("forward_failures"), "{:.0f}")))
    if rows:
        widths = [max(len(r[i]) for r in (head, *rows)) for i in range(len(head))]
        lines.append("")
        lines += ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
                  for r in (head, *rows)]
    for g in v["groups"]:
        lines += [f"group {g['group']}: UNREACHABLE {e}" for e in g["errors"]]
    return "\n".join(lines)


def unreachable(v: dict) -> list[str]:
    out = [f"tokenizers: {v['tokenizer']['error']}"] if v["tokenizer"] and "error" in v["tokenizer"] else []
    return out + [e for g in v["groups"] for e in g["errors"]]


def main(argv: list[str] | None = None) -> int:
    ap = Parser(prog="banyan top", description=(
        "Live view of a running deployment: per group running / waiting requests, KV usage, cache hit rate, "
        "computed tokens/s and step time; tokens/s in and out, TTFT / ITL / e2e percentiles and errors from the "
        "tokenizers. Scrapes the Prometheus endpoints every --interval seconds."))
    ap.add_argument("urls", nargs="*", help="metrics endpoints (host:port or URLs), each recognised by what it "
                    "serves: the tokenizers' HTTP port, schedulers and workers (in group order)")
    ap.add_argument("--ready-file", default=os.environ.get("BANYAN_READY_FILE", ""),
                    help="the --ready-file of banyan serve: every endpoint from it [env BANYAN_READY_FILE]")
    ap.add_argument("--host", default="127.0.0.1", help="host of the ports in the ready file")
    ap.add_argument("--wait", type=float, default=0.0,
                    help="seconds to wait for the ready file to appear (a banyan serve starting; default 0)")
    ap.add_argument("--interval", type=float, default=2.0, help="seconds between scrapes (default 2)")
    ap.add_argument("--once", action="store_true", help="print one snapshot (two scrapes --interval apart) and exit")
    ap.add_argument("--json", action="store_true", help="with --once: the snapshot as JSON")
    ns = ap.parse_args(argv)
    if ns.interval <= 0:
        ap.error("--interval must be > 0")
    if bool(ns.urls) == bool(ns.ready_file):
        ap.error("give either --ready-file PATH (as passed to banyan serve) or the metrics URLs")
    deadline = time.monotonic() + ns.wait
    while ns.ready_file and not os.path.exists(ns.ready_file) and time.monotonic() < deadline:
        time.sleep(0.2)
    if ns.ready_file and not os.path.exists(ns.ready_file):  # (the file lives as long as its server)
        print(f"banyan top: error: no ready file {ns.ready_file}: no `banyan serve --ready-file {ns.ready_file}` is "
              "serving (--wait N waits for one starting)", file=sys.stderr)
        return 1
    try:
        eps = from_ready_file(ns.ready_file, ns.host) if ns.ready_file else from_urls(ns.urls)
    except (OSError, ValueError) as e:
        print(f"banyan top: error: {e}", file=sys.stderr)
        return 1
    if not eps.urls():
        print("banyan top: error: the deployment exposes no metrics endpoint", file=sys.stderr)
        return 1
    top = Top(eps)
    top.poll()
    if ns.once or ns.json:
        time.sleep(ns.interval)
        top.poll()
        v = top.view()
        print(json.dumps(v, indent=1) if ns.json else render(v))
        bad = unreachable(v)
        for e in bad:
            print(f"banyan top: error: unreachable: {e}", file=sys.stderr)
        return 1 if bad else 0
    tty = sys.stdout.isatty()
    try:
        while True:
            time.sleep(ns.interval)
            top.poll()
            text = render(top.view()) + f"\n\nevery {ns.interval:g} s — Ctrl-C quits"
            sys.stdout.write(("\x1b[H\x1b[2J" if tty else "\n") + text + "\n")
            sys.stdout.flush()
    except KeyboardInterrupt:
        return 0
