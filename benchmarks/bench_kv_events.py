"""CPU micro-benchmark of KV-cache events (services/scheduler/kv_events.py): what the prefix cache's
inserts and evictions cost with nobody listening (the cache's listener is None: one attribute test
per insert or eviction) and with a subscribed replica (block hashes of every change, one batch per
step), on the workload a serving step sees: prompts of a few system prompts × unique tails
(``--prompt-len`` tokens), inserted after prefill, then their outputs on finish, with evictions to
stay inside ``--pool`` tokens. Prints µs per operation (median, p99) and writes JSON.

    python -m benchmarks.bench_kv_events [--out benchmarks/results/kv_events_cpu.json] [--page-size 16]

The serving-level check (the suite's W2 with SMG's service on and no subscriber vs
``--disable-smg-grpc``) runs on a GPU: see README, "Running behind SMG".
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from services.scheduler.cache import RadixCache  # noqa: E402
from services.scheduler.kv_events import KvEventPublisher  # noqa: E402

VOCAB = 128_000


def run(listen: bool, args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    free: list[int] = list(range(1, args.pool + 1))
    cache = RadixCache(lambda slots: free.extend(slots), args.page_size)
    batches = []
    pub = KvEventPublisher(args.page_size, lambda r, m: batches.append(m))
    pub.attach(cache)
    if listen:
        pub.subscribe(b"replica", True)
    systems = [[rng.randrange(VOCAB) for _ in range(args.prompt_len // 2)] for _ in range(8)]
    insert_ns, evict_ns, flush_ns = [], [], []
    for _ in range(args.requests):
        key = rng.choice(systems) + [rng.randrange(VOCAB) for _ in range(args.prompt_len // 2 + args.output_len)]
        n = len(key) - len(key) % args.page_size
        if len(free) < n:
            t = time.perf_counter_ns()
            cache.evict(n - len(free))
            evict_ns.append(time.perf_counter_ns() - t)
        slots = [free.pop() for _ in range(n)]
        firsts = []
        for end in (args.prompt_len, n):  # after prefill, then on finish
            t = time.perf_counter_ns()
            firsts.append(cache.insert("", key[:end], slots[:end]))
            insert_ns.append(time.perf_counter_ns() - t)
        free.extend(slots[:firsts[0].cached])  # (the prefix cached before: the caller's duplicates)
        t = time.perf_counter_ns()
        pub.flush()
        flush_ns.append(time.perf_counter_ns() - t)
    events = sum(len(b.events) for b in batches)

    def us(xs: list[int]) -> dict:
        xs = sorted(xs) or [0]
        return {"median_us": statistics.median(xs) / 1e3, "p99_us": xs[int(0.99 * (len(xs) - 1))] / 1e3,
                "count": len(xs)}

    return {"listening": listen, "insert": us(insert_ns), "evict": us(evict_ns), "flush": us(flush_ns),
            "batches": len(batches), "events": events, "block_size": pub.block_size}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/kv_events_cpu.json"))
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--pool", type=int, default=1 << 18, help="KV slots (tokens)")
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--requests", type=int, default=600)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rows = [run(False, args), run(True, args)]
    heads = [f"{op} µs p50/p99" for op in ("insert", "evict", "flush")]
    print(f"{'listener':>10} | " + " | ".join(f"{h:>18}" for h in heads) + " | events")
    for r in rows:
        cells = [f"{r[k]['median_us']:7.1f} / {r[k]['p99_us']:7.1f}" for k in ("insert", "evict", "flush")]
        print(f"{'subscribed' if r['listening'] else 'none':>10} | " + " | ".join(f"{c:>18}" for c in cells)
              + f" | {r['events']}")
    doc = {"benchmark": "kv_events_cpu", "args": vars(args) | {"out": str(args.out)}, "results": rows,
           "python": platform.python_version(), "machine": platform.machine()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
