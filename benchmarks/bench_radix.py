"""CPU micro-benchmark of the radix prefix cache (metadata only: no tensors).

Builds a RadixCache holding >= 1M tokens: sequences of ~2k tokens over a 128k-token vocabulary,
grouped the way serving traffic is (a few system prompts, each followed by one of a few few-shot
blocks, then a unique conversation; some sequences skip the few-shot block), then times single
calls of ``match`` / ``peek`` (full hits, deep and shallow partial hits, misses), ``insert`` (new
tails under shared prefixes, and keys that are already cached) and ``evict`` with
``time.perf_counter_ns``. Prints a table of µs per op (median, p99) and writes JSON.

    python -m benchmarks.bench_radix [--out benchmarks/results/radix_cpu.json] [--page-size 1]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
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

VOCAB = 128_000
KEY_LEN = 2048
GOAL_MATCH_US = 50.0


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


class Slots:
    """Hands out fresh slot ids and counts what the cache frees."""

    def __init__(self) -> None:
        self.next = 1
        self.freed = 0

    def take(self, n: int) -> list[int]:
        out = list(range(self.next, self.next + n))
        self.next += n
        return out

    def free(self, slots) -> None:
        self.freed += len(slots)


def tree_size(cache: RadixCache) -> tuple[int, int]:
    """(cached tokens, nodes without the roots)."""
    nodes = 0
    for root in cache._roots.values():
        stack = list(root.children.values())
        while stack:
            n = stack.pop()
            nodes += 1
            stack.extend(n.children.values())
    return cache.evictable_size + cache.locked_size, nodes


def build(rng: random.Random, min_tokens: int, min_seqs: int, page_size: int):
    """The cache, its sequences and their shared prefixes (system prompts, system + few-shot)."""
    slots = Slots()
    cache = RadixCache(slots.free, page_size)
    systems = [tokens(rng, rng.randint(100, 800)) for _ in range(12)]
    fewshots = [[s + tokens(rng, rng.randint(150, 500)) for _ in range(4)] for s in systems]
    seqs: list[list[int]] = []
    while cache.evictable_size < min_tokens or len(seqs) < min_seqs:
        g = rng.randrange(len(systems))
        head = systems[g] if rng.random() < 0.25 else rng.choice(fewshots[g])
        if rng.random() < 0.05:
            head = []  # unrelated to any group
        seq = head + tokens(rng, max(64, rng.randint(KEY_LEN - 256, KEY_LEN + 256) - len(head)))
        cache.insert("", seq, slots.take(len(seq)))
        seqs.append(seq)
    return cache, slots, seqs, systems, [f for fs in fewshots for f in fs]


def timed(fn, args_list: list) -> list[int]:
    out = []
    clock = time.perf_counter_ns
    for args in args_list:
        t0 = clock()
        fn(*args)
        out.append(clock() - t0)
    return out


def summarize(name: str, ns_list: list[int], hit: float | None) -> dict:
    us = sorted(x / 1e3 for x in ns_list)
    p99 = us[min(len(us) - 1, int(round(0.99 * (len(us) - 1))))]
    return dict(op=name, n=len(us), median_us=round(statistics.median(us), 2), p99_us=round(p99, 2),
                mean_us=round(statistics.fmean(us), 2), max_us=round(us[-1], 2),
                mean_hit_tokens=None if hit is None else round(hit, 1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "radix_cpu.json"))
    ap.add_argument("--page-size", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=1_000_000, help="minimum cached tokens")
    ap.add_argument("--seqs", type=int, default=600, help="minimum sequences")
    ap.add_argument("--ops", type=int, default=2000, help="timed calls per match/peek/insert case")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    t_start = time.perf_counter()

    t0 = time.perf_counter()
    cache, slots, seqs, systems, heads = build(rng, args.tokens, args.seqs, args.page_size)
    build_s = time.perf_counter() - t0
    size_tokens, size_nodes = tree_size(cache)
    P, N = args.page_size, args.ops

    def deep_key() -> list[int]:  # a cached sequence, diverging somewhere in its unique part
        s = rng.choice(seqs)
        cut = rng.randint(len(s) // 2, len(s) - 1)
        return (s[:cut] + tokens(rng, KEY_LEN))[:KEY_LEN]

    def shallow_key() -> list[int]:  # a shared prefix (system or system + few-shot), then new
        h = rng.choice(systems + heads)
        return h + tokens(rng, KEY_LEN - len(h))

    cases = {
        "full hit": lambda: rng.choice(seqs)[:KEY_LEN],
        "deep hit": deep_key,
        "shallow hit": shallow_key,
        "miss": lambda: tokens(rng, KEY_LEN),
    }
    keys = {name: [make() for _ in range(N)] for name, make in cases.items()}
    results: list[dict] = []

    gc.collect()
    gc.disable()  # time the cache, not the cyclic collector (as timeit does)
    try:
        for name, ks in keys.items():
            hits = [cache.peek("", k).length for k in ks]
            results.append(summarize(f"peek {name}", timed(cache.peek, [("", k) for k in ks]),
                                     statistics.fmean(hits)))
        for name, ks in keys.items():
            hits: list[int] = []
            results.append(summarize(f"match {name}", timed(lambda k: hits.append(len(cache.match("", k).slots)), [(k,) for k in ks]),
                                     None))
            results[-1]["mean_hit_tokens"] = round(statistics.fmean(hits), 1)
        # inserts: new tails under shared prefixes (one new leaf each, often a split), then keys
        # that are already cached (a walk, nothing stored)
        new_keys = [shallow_key() if i % 2 else deep_key() for i in range(N)]
        done: list[int] = []
        ns = timed(lambda k, s: done.append(cache.insert("", k, s).cached),
                   [(k, slots.take(len(k))) for k in new_keys])
        results.append(summarize("insert new tail", ns, statistics.fmean(done)))
        seqs.extend(new_keys)
        dup = [rng.choice(seqs)[:KEY_LEN] for _ in range(N)]
        done = []
        ns = timed(lambda k, s: done.append(cache.insert("", k, s).cached), [(k, slots.take(len(k))) for k in dup])
        results.append(summarize("insert cached key", ns, statistics.fmean(done)))
        # lock/unlock of a 2k-token path (what admit/release do besides match/insert)
        nodes = [cache.match("", rng.choice(seqs)[:KEY_LEN]).handle for _ in range(N)]
        results.append(summarize("lock", timed(cache.lock, [(n,) for n in nodes]), None))
        results.append(summarize("unlock", timed(cache.unlock, [(n,) for n in nodes]), None))
        # eviction: one ~2k-token request's worth at a time, LRU leaves first
        before = slots.freed
        n_ev = min(N, max(1, cache.evictable_size // (4 * KEY_LEN)))
        results.append(summarize(f"evict {KEY_LEN}", timed(cache.evict, [(KEY_LEN,)] * n_ev), None))
        evicted = slots.freed - before
        results[-1]["mean_freed_tokens"] = round(evicted / n_ev, 1)
    finally:
        gc.enable()
    cache.check_integrity()
    end_tokens, end_nodes = tree_size(cache)
    total_s = time.perf_counter() - t_start

    print(f"RadixCache page_size={P}: {size_tokens:,} tokens in {size_nodes:,} nodes "
          f"({len(seqs) - N:,} sequences, built in {build_s:.2f} s); after the run: {end_tokens:,} tokens, "
          f"{end_nodes:,} nodes")
    print(f"{'op':<26}{'n':>6}{'median µs':>12}{'p99 µs':>10}{'mean µs':>10}{'hit/freed':>11}")
    for r in results:
        extra = r.get("mean_freed_tokens", r["mean_hit_tokens"])
        print(f"{r['op']:<26}{r['n']:>6}{r['median_us']:>12.2f}{r['p99_us']:>10.2f}{r['mean_us']:>10.2f}"
              f"{'' if extra is None else f'{extra:>11.0f}'}")
    worst = max(r["median_us"] for r in results if r["op"].startswith("match"))
    print(f"match goal < {GOAL_MATCH_US:.0f} µs (median): {'met' if worst < GOAL_MATCH_US else 'MISSED'} "
          f"(worst case {worst:.1f} µs); total {total_s:.1f} s")

    out = dict(
        benchmark="radix_cpu", key_len=KEY_LEN, vocab=VOCAB, page_size=P, seed=args.seed,
        tree=dict(tokens=size_tokens, nodes=size_nodes, sequences=len(seqs) - N, build_s=round(build_s, 3),
                  tokens_after=end_tokens, nodes_after=end_nodes),
        ops=results, goal_match_median_us=GOAL_MATCH_US, goal_met=worst < GOAL_MATCH_US,
        python=platform.python_version(), machine=platform.machine(), cpu_count=os.cpu_count(),
        total_s=round(total_s, 2),
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
