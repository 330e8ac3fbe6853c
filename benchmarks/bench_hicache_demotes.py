"""W2H's shape on the CPU: offline requests that outlive a host tier smaller than the KV pool
(write-through). Counts what the tier copied and how many tokens the pool demoted on eviction — the
copies a forward waits for, which cost W2H ~3.5 % on the H200 (docs/perf.md, tenth session).

    python -m benchmarks.bench_hicache_demotes --out results.json [--work DIR]

A tiny random-weight model on the CPU; prints a table and writes JSON. Counts, not speed."""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from banyan.demo import ensure_demo_model
from benchmarks.gpu import suite_workloads as wl
from benchmarks.gpu.suite_counters import tier_counters
from tests.support import Server, make_tiny_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="JSON results")
    ap.add_argument("--work", type=Path, default=None, help="model and log directory (default: a temporary one)")
    ap.add_argument("--pool", type=int, default=6000, help="KV pool tokens (--max-total-tokens)")
    ap.add_argument("--host-ratio", type=float, default=0.4, help="host tier size × the pool (--hicache-ratio)")
    ap.add_argument("--requests", type=int, default=96)
    a = ap.parse_args()
    work = a.work or Path(tempfile.mkdtemp(prefix="bench_hicache_"))
    model = make_tiny_model("llama", work / "model", ensure_demo_model(str(work / "cache")), seed=3,
                            max_positions=2048)
    s = Server(str(model), work / "server.log", "--device", "cpu", "--http-port", "-1", "--max-total-tokens",
               str(a.pool), "--hicache-ratio", str(a.host_ratio), "--max-running-requests", "24")
    try:
        sizes = wl.Sizes(w2_num=a.requests, w2_input=(64, 256), w2_output=(32, 160), hf_subset=0)
        t0 = time.perf_counter()
        res = wl.w2(s.target, sizes, 1000)
        seconds = time.perf_counter() - t0
        tier = tier_counters(s) or {}
    finally:
        s.stop()
    doc = {"pool": a.pool, "host_ratio": a.host_ratio, "requests": a.requests, "completed": res["completed"],
           "failed": res["failed"], "seconds": seconds, "load": res["load"], "tier": tier}
    print("| requests done | tokens evicted | device → host MB | tokens demoted |\n| ---: | ---: | ---: | ---: |")
    print(f"| {res['completed']} | {res['load']['evicted_tokens']:,} | "
          f"{tier.get('moved_bytes|device_to_host', 0) / 1e6:,.1f} | {tier.get('demoted_tokens', 0):,.0f} |")
    if a.out:
        a.out.write_text(json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()
