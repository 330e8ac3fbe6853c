"""Where a run's device idle sits: a summary of the worker's step trace (``BANYAN_STEP_TRACE``,
``services/worker/step_trace.py``; the suite writes one per server with ``--step-trace``).

    python -m benchmarks.gpu.step_trace OUT/suite/steps_main.jsonl [--kind decode_eager] [--top 12]

Per step kind: steps, device ms, idle ms (sum, p50, p90, max), the worker's host ms to queue a step,
and the scheduler's turnaround (``recv`` of step N+2 minus ``answered`` of N: it builds N+2 once it
has applied N); then the steps with the most idle before them, with their neighbours, and the idle
by tenth of the run (is it spread out, or at the start and the end?)."""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
from pathlib import Path


def load(path: Path) -> list[dict]:
    """A trace's steps in step order (``.gz``: gzip-compressed, as the results directories keep them)."""
    text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
    steps = [json.loads(line) for line in text.splitlines() if line.strip()]
    steps.sort(key=lambda s: s["step"])
    by_id = {s["step"]: s for s in steps}
    for s in steps:
        s["host_ms"] = s["queued"] - s["recv"]
        before = by_id.get(s["step"] - 2)
        s["turnaround_ms"] = s["recv"] - before["answered"] if before is not None else None
    return steps


def _q(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))] if xs else float("nan")


def summary(steps: list[dict], kind: str | None, top: int) -> str:
    lines = ["| kind | steps | device ms p50 | idle ms sum · p50 · p90 · max | host ms p50 · p90 | turnaround ms "
             "p50 · p90 · max |", "| --- | ---: | ---: | --- | --- | --- |"]
    for k in sorted({s["kind"] for s in steps}):
        ks = [s for s in steps if s["kind"] == k]
        idle = [s["idle_ms"] for s in ks]
        host = [s["host_ms"] for s in ks]
        turn = [s["turnaround_ms"] for s in ks if s["turnaround_ms"] is not None]
        lines.append(f"| {k} | {len(ks)} | {statistics.median(s['device_ms'] for s in ks):.2f} | {sum(idle):.0f} · "
                     f"{_q(idle, .5):.2f} · {_q(idle, .9):.2f} · {max(idle):.2f} | {_q(host, .5):.2f} · "
                     f"{_q(host, .9):.2f} | {_q(turn, .5):.2f} · {_q(turn, .9):.2f} · "
                     f"{max(turn) if turn else float('nan'):.2f} |")
    pick = [s for s in steps if kind in (None, s["kind"])]
    lines.append(f"\nmost idle before them ({kind or 'all kinds'}): step (kind, rows) idle · host · turnaround ms")
    index = {s["step"]: i for i, s in enumerate(steps)}
    for s in sorted(pick, key=lambda s: -s["idle_ms"])[:top]:
        i = index[s["step"]]
        near = " ".join(f"{t['kind']}/{t['rows']}" for t in steps[max(0, i - 2):i])
        lines.append(f"  {s['step']} ({s['kind']}, {s['rows']}) {s['idle_ms']:.2f} · {s['host_ms']:.2f} · "
                     f"{s['turnaround_ms'] if s['turnaround_ms'] is None else round(s['turnaround_ms'], 2)}"
                     f"   after: {near}")
    if pick:
        n = len(pick)
        tenths = [sum(s["idle_ms"] for s in pick[i * n // 10:(i + 1) * n // 10]) for i in range(10)]
        lines.append("idle ms by tenth of the run: " + " ".join(f"{t:.0f}" for t in tenths))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", type=Path)
    ap.add_argument("--kind", default=None, help="only this kind in the idle list (e.g. decode_eager)")
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args(argv)
    print(summary(load(args.trace), args.kind, args.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
