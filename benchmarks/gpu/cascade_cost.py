"""What a shared-prefix (cascade) decode step costs against a plain one, on the worker alone: the
numbers behind the scheduler's cost rule (``CascadePolicy``). GPU; from the repo root:

    python -m benchmarks.gpu.cascade_cost --model /tmp/llama8b --out OUT.json

For W3-like batches — G groups of M requests whose first P tokens are one shared prefix (the same KV
slots, as the radix cache hands them out), each with S tokens of its own — it times decode steps
(``ModelRunner.execute``, synchronous: host work included) three ways: plain through the CUDA graph
(when the batch fits one), plain eager, and cascade (eager: grouped steps never replay a graph).
Prints a table and the two rates the rule needs: what running eagerly costs per step (graph vs
eager, plain), and what one KV token not read saves (plain eager vs cascade, per saved token).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT)]

from benchmarks.driver import Driver  # noqa: E402
from services.worker.runner import ModelRunner  # noqa: E402
from shared.config import WorkerConfig  # noqa: E402

SHAPES = ((8, 32), (32, 8), (16, 32), (32, 32))  # (groups, members): 256, 256, 512, 1024 requests


def fill(driver: Driver, groups: int, members: int, prefix: int, own: int, vocab: int, tag: str) -> list[str]:
    """Prefill the shared prefixes and every member's own tokens; → the member ids, group by group."""
    rng = np.random.default_rng(0)
    budget = 16384
    for g in range(groups):
        owner = f"{tag}o{g}"
        for start in range(0, prefix, 8192):
            driver.run([(owner, rng.integers(0, vocab, min(8192, prefix - start)).tolist(), False)])
    rids = [f"{tag}g{g}.{m}" for g in range(groups) for m in range(members)]
    for rid in rids:
        driver.share(rid, f"{tag}o{rid[len(tag) + 1:].split('.')[0]}", prefix)
    per = max(1, budget // own)
    for i in range(0, len(rids), per):
        driver.run([(rid, rng.integers(0, vocab, own).tolist(), True) for rid in rids[i:i + per]])
    return rids


def steps(runner: ModelRunner, driver: Driver, rids: list[str], n: int, eager: bool,
          cascade: tuple[list[int], list[int]] | None) -> tuple[float, float]:
    """Median (wall ms, device busy ms) of ``n`` decode steps of ``rids``."""
    graphs = runner.graphs
    if eager:
        runner.graphs = None
    wall, busy = [], []
    try:
        for _ in range(n):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            t = time.perf_counter()
            driver.run([(rid, [-1], True) for rid in rids], cascade=cascade)
            wall.append(time.perf_counter() - t)
            busy.append(runner.busy_s)
    finally:
        runner.graphs = graphs
    k = n // 4  # warm-up steps dropped
    return statistics.median(wall[k:]) * 1e3, statistics.median(busy[k:]) * 1e3


def profile(runner: ModelRunner, driver: Driver, rids: list[str], cascade, out: Path | None) -> str:
    """Kernel and host-call totals of 3 plain eager and 3 cascade steps (torch.profiler)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    text = []
    for name, groups in (("plain eager", None), ("cascade", cascade)):
        steps(runner, driver, rids, 2, True, groups)  # warm
        with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
            steps(runner, driver, rids, 3, True, groups)
        text.append(f"=== {name}: by CUDA time\n" + p.key_averages().table(sort_by="cuda_time_total", row_limit=22))
        text.append(f"=== {name}: by CPU time\n" + p.key_averages().table(sort_by="self_cpu_time_total", row_limit=14))
        if out is not None:
            p.export_chrome_trace(str(out.with_name(out.stem + f"_{name.split()[0]}_trace.json")))
    return "\n".join(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="/tmp/llama8b")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--prefix", type=int, default=2048)
    ap.add_argument("--own", type=int, default=256)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--graph-max-bs", type=int, default=512)
    ap.add_argument("--shapes", default=",".join(f"{g}x{m}" for g, m in SHAPES))
    ap.add_argument("--profile", action="store_true", help="profile the first shape's plain and cascade steps")
    ap.add_argument("--device", default="auto", help="auto | cuda | cpu (a CPU run checks the script, not speed)")
    ap.add_argument("--kv-cache-dtype", default="auto", help="auto | fp8_e4m3 (the pool's dtype)")
    args = ap.parse_args()
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    need = sum(g * args.prefix + g * m * (args.own + 3 * args.steps + 8) for g, m in shapes)
    cfg = WorkerConfig(model=args.model, max_total_tokens=need + 4096, device=args.device,
                       cuda_graph_max_bs=args.graph_max_bs, kv_cache_dtype=args.kv_cache_dtype)
    runner = ModelRunner(cfg, args.model)
    driver = Driver(runner, max_rows=max(g * m + g for g, m in shapes) * 2)
    vocab = runner.spec.vocab_size
    rows = []
    for g, m in shapes:
        tag = f"s{g}x{m}"
        rids = fill(driver, g, m, args.prefix, args.own, vocab, tag)
        bs = len(rids)
        groups = ([i // m for i in range(bs)], [args.prefix] * g)
        ctx = args.prefix + args.own
        row = {"groups": g, "members": m, "batch": bs, "prefix": args.prefix, "own": args.own,
               "kv_tokens_plain": bs * ctx, "kv_tokens_saved": (bs - g) * args.prefix}
        if runner.graphs is not None and runner.graphs.size_for(bs) is not None:
            row["plain_graph_ms"], row["plain_graph_busy_ms"] = steps(runner, driver, rids, args.steps, False, None)
        row["plain_eager_ms"], row["plain_eager_busy_ms"] = steps(runner, driver, rids, args.steps, True, None)
        row["cascade_ms"], row["cascade_busy_ms"] = steps(runner, driver, rids, args.steps, True, groups)
        row["saved_us_per_1k_tokens"] = (row["plain_eager_ms"] - row["cascade_ms"]) / row["kv_tokens_saved"] * 1e6
        if "plain_graph_ms" in row:
            row["eager_overhead_ms"] = row["plain_eager_ms"] - row["plain_graph_ms"]
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.profile and len(rows) == 1:
            report = profile(runner, driver, rids, groups, args.out)
            if args.out:
                args.out.with_name(args.out.stem + "_profile.txt").write_text(report)
        for rid in rids + [f"{tag}o{i}" for i in range(g)]:
            driver.release(rid)
    doc = {"device": torch.cuda.get_device_name() if runner.device.type == "cuda" else "cpu", "model": args.model,
           "rows": rows}
    if args.out:
        args.out.write_text(json.dumps(doc, indent=1))
    print("\n| groups x members | batch | plain graph ms | plain eager ms | cascade ms | saved KV tokens | "
          "us / 1k saved | eager overhead ms |\n|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['groups']} x {r['members']} | {r['batch']} | {r.get('plain_graph_ms', float('nan')):.2f} | "
              f"{r['plain_eager_ms']:.2f} | {r['cascade_ms']:.2f} | {r['kv_tokens_saved']} | "
              f"{r['saved_us_per_1k_tokens']:.1f} | {r.get('eager_overhead_ms', float('nan')):.2f} |")


if __name__ == "__main__":
    main()
