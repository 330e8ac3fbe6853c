"""Which engine steps made W7's slow inter-token gaps: the interactive requests' token arrivals (the
suite's ``interactive_token_epochs``, Unix seconds at the client) lined up with the worker's step
trace (``--step-trace``: each step's kind, rows, tokens and device ms, and ``t``, the wall clock when
its results were sent). A token that arrives at T came from the last step answered before T; a gap
is attributed to the step that ended it, and to any other step answered inside it (a step the
request sat out, or a front end that was late).

    python -m benchmarks.gpu.itl_trace OUT/w7/suite_w7.json OUT/w7/steps_w7_priority.jsonl [--over MS] [--top 8]

Prints the gaps' quantiles, the gaps over ``--over`` ms (default: twice the idle ITL p99, the issue's
bound) by the kind of step that ended them and by that step's prompt tokens (tokens beyond one a row),
and the slowest gaps with their steps.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import json
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[2])]

from benchmarks.gpu.stage_trace import load_steps, quantile  # noqa: E402


def gaps(epochs: list[list[float]]) -> list[tuple[float, float]]:
    """(previous arrival, arrival) of every later token of every request (tokens of one message: one gap)."""
    out = []
    for times in epochs:
        distinct = sorted(set(times))
        out += list(zip(distinct, distinct[1:], strict=False))
    return out


def attribute(gap: tuple[float, float], steps: list[dict], ts: list[float]) -> list[dict]:
    """The steps answered within the gap ``(a, b]`` (the last of them ended it), or the last step
    answered before ``b`` when none was."""
    a, b = gap
    lo, hi = bisect.bisect_right(ts, a), bisect.bisect_right(ts, b)
    return steps[lo:hi] if hi > lo else steps[max(0, hi - 1):hi]


def prompt_tokens(step: dict) -> int:
    return max(0, step["tokens"] - step["rows"])


def bucket(n: int) -> str:
    for top in (0, 128, 512, 1024):
        if n <= top:
            return f"≤ {top}"
    return "> 1024"


def report(epochs: list[list[float]], steps: list[dict], over_ms: float, top: int) -> str:
    steps = sorted(steps, key=lambda s: s["t"])
    ts = [s["t"] for s in steps]
    all_gaps = gaps(epochs)
    if not all_gaps or not steps:
        return "no gaps or no steps to line up"
    ms = [(b - a) * 1e3 for a, b in all_gaps]
    lines = [f"{len(ms)} gaps of {len(epochs)} requests: p50 {quantile(ms, 0.5):.1f} · p90 {quantile(ms, 0.9):.1f} · "
             f"p99 {quantile(ms, 0.99):.1f} · max {max(ms):.1f} ms; over {over_ms:.1f} ms: "
             f"{sum(m > over_ms for m in ms)} ({sum(m > over_ms for m in ms) / len(ms):.1%})"]
    by_kind: collections.Counter = collections.Counter()
    by_prompt: collections.Counter = collections.Counter()
    slow = sorted(((m, g) for m, g in zip(ms, all_gaps, strict=True) if m > over_ms), reverse=True)
    for _, g in slow:
        ended = attribute(g, steps, ts)
        if ended:
            by_kind[ended[-1]["kind"] + (" (+ steps sat out)" if len(ended) > 1 else "")] += 1
            by_prompt[bucket(prompt_tokens(ended[-1]))] += 1
    if slow:
        lines.append("| gaps over the bound, by the step that ended them | n |\n| --- | ---: |")
        lines += [f"| {k} | {n} |" for k, n in by_kind.most_common()]
        lines.append("| … by its prompt tokens (tokens beyond one a row) | n |\n| --- | ---: |")
        lines += [f"| {k} | {n} |" for k, n in sorted(by_prompt.items())]
    for m, g in slow[:top]:
        lines.append(f"gap {m:.1f} ms ending at {g[1]:.3f}:")
        for st in attribute(g, steps, ts):
            lines.append(f"    step {st['step']} {st['kind']} rows {st['rows']} tokens {st['tokens']} device "
                         f"{st['device_ms']:.1f} ms, answered {(st['t'] - g[0]) * 1e3:+.1f} ms into the gap")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("suite_json", type=Path, help="the suite's JSON with a W7 result")
    ap.add_argument("steps", type=Path, help="the priority-on server's step trace (steps_w7_priority.jsonl)")
    ap.add_argument("--run", default="priority_on", choices=("priority_on", "priority_off"))
    ap.add_argument("--over", type=float, default=None, help="ms; default: 2 × the idle ITL p99")
    ap.add_argument("--top", type=int, default=8)
    args = ap.parse_args()
    w7 = json.loads(args.suite_json.read_text())["results"]["W7"]
    epochs = w7[args.run].get("interactive_token_epochs") or []
    steps = load_steps(args.steps)
    over = args.over if args.over is not None else 2 * w7["idle"]["itl_ms"]["p99"]
    print(report(epochs, steps, over, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
