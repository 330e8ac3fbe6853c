"""How close an offline run is to the floor its own step rates set (W2-style: many prompts, then decodes).

    python -m benchmarks.gpu.run_floor OUT/suite/steps_w2.jsonl[.gz] [--run N] [--goal 6400]

Reads the worker's step trace (``BANYAN_STEP_TRACE``; the suite's ``--step-trace``), splits it into runs at
host gaps (a step received more than ``--gap-ms`` after the one before was answered: the suite's next
workload, a warm-up before it), and for one run (the longest unless ``--run``) measures two rates from its own steps:

- **a decode row at full batch**: device ms ÷ rows of the decode-only steps within 5 % of the run's largest
  decode batch (the cheapest a decode row gets: weights amortized over the most rows; at these batches the
  GEMMs are compute-bound and the attention reads each row's context, so a larger batch would not make a row
  cheaper);
- **a prompt token in a large chunk**: the steps carrying ≥ ``--chunk`` prompt tokens, their decode rows
  taken out at the rate above, ÷ their prompt tokens.

A step's tokens are its prompt tokens plus one a decode row; a step's rows are its decode rows plus a row a
prompt chunk (a few a step), so a mixed step's prompt tokens are taken as tokens − rows (short by that few).
The floor is every prompt token and every decode row at those rates and no per-step cost beyond them: what
the run would take were every step as efficient as the run's best steps. It prints the run's device time,
the floor, and the rates a goal in output tok/s would need (both rates scaled alike), and a least-squares fit
of ms = base + prompt·µs + rows·µs over all steps as a check."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from benchmarks.gpu import step_trace


def load_runs(path: Path, gap_ms: float) -> list[list[dict]]:
    runs: list[list[dict]] = []
    for s in step_trace.load(path):
        if not runs or s["recv"] - runs[-1][-1]["answered"] > gap_ms:
            runs.append([])
        runs[-1].append(s)
    return runs


def _prompt_tokens(s: dict) -> int:
    """A step's prompt tokens (0 for a decode-only step; a mixed step's tokens less its rows, see above)."""
    return 0 if s["kind"].startswith("decode") else s["tokens"] - s["rows"]


def rates(run: list[dict], chunk: int) -> dict:
    decode = [s for s in run if s["kind"].startswith("decode")]
    prompt = [s for s in run if not s["kind"].startswith("decode")]
    if not decode or not prompt:
        raise SystemExit("the run needs decode-only steps and steps with prompts")
    top = max(s["rows"] for s in decode)
    full = [s for s in decode if s["rows"] >= 0.95 * top]
    row_us = 1e3 * sum(s["device_ms"] for s in full) / sum(s["rows"] for s in full)
    big = [s for s in prompt if _prompt_tokens(s) >= chunk]
    if not big:
        raise SystemExit(f"no step carries >= {chunk} prompt tokens (--chunk)")
    tok_us = 1e3 * sum(s["device_ms"] - s["rows"] * row_us / 1e3 for s in big) / sum(map(_prompt_tokens, big))
    x = np.array([[1.0, _prompt_tokens(s), s["rows"]] for s in run])
    fit = np.linalg.lstsq(x, np.array([s["device_ms"] for s in run]), rcond=None)[0]
    return {"full_batch_rows": top, "full_batch_steps": len(full), "decode_row_us": row_us,
            "large_chunk_steps": len(big), "prompt_token_us": tok_us,
            "fit": {"base_ms": fit[0], "prompt_token_us": fit[1] * 1e3, "row_us": fit[2] * 1e3}}


def floor(run: list[dict], chunk: int, goal: float | None) -> dict:
    r = rates(run, chunk)
    prompt_tokens = sum(map(_prompt_tokens, run))
    decode_rows = sum(s["rows"] for s in run)  # (a prompt's last chunk samples its first token: a row too)
    device_s = sum(s["device_ms"] for s in run) / 1e3
    wall_s = (run[-1]["answered"] - run[0]["recv"]) / 1e3
    floor_s = (prompt_tokens * r["prompt_token_us"] + decode_rows * r["decode_row_us"]) / 1e6
    out = {**r, "steps": len(run), "prompt_tokens": prompt_tokens, "decode_rows": decode_rows,
           "device_s": device_s, "wall_s": wall_s, "floor_s": floor_s, "output_tok_s": decode_rows / wall_s,
           "floor_output_tok_s": decode_rows / floor_s}
    if goal:
        need_s = decode_rows / goal
        out.update(goal=goal, goal_s=need_s, goal_rates_scale=need_s / floor_s)
    return out


def table(res: dict) -> str:
    f = res["fit"]
    rows = [
        ("steps · prompt tokens · output tokens (rows sampled)",
         f"{res['steps']} · {res['prompt_tokens']:,} · {res['decode_rows']:,}"),
        ("wall s · device s · output tok/s",
         f"{res['wall_s']:.2f} · {res['device_s']:.2f} · {res['output_tok_s']:,.0f}"),
        (f"decode row at full batch ({res['full_batch_rows']} rows, {res['full_batch_steps']} steps), µs",
         f"{res['decode_row_us']:.1f}"),
        (f"prompt token in large chunks ({res['large_chunk_steps']} steps), µs", f"{res['prompt_token_us']:.2f}"),
        ("floor at those rates, s · output tok/s · device ÷ floor",
         f"{res['floor_s']:.2f} · {res['floor_output_tok_s']:,.0f} · {res['device_s'] / res['floor_s']:.3f}"),
        ("least squares: base ms a step · µs a prompt token · µs a row",
         f"{f['base_ms']:.2f} · {f['prompt_token_us']:.2f} · {f['row_us']:.1f}"),
    ]
    if "goal" in res:
        rows.append((f"{res['goal']:,.0f} output tok/s: s · both rates × (at the floor, no per-step cost)",
                     f"{res['goal_s']:.2f} · {res['goal_rates_scale']:.3f}"))
    return "\n".join(["| | |", "| --- | ---: |"] + [f"| {a} | {b} |" for a, b in rows])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", type=Path)
    ap.add_argument("--run", type=int, default=None, help="which run of the trace (split at host gaps; default: "
                    "the longest)")
    ap.add_argument("--gap-ms", type=float, default=300.0)
    ap.add_argument("--chunk", type=int, default=8192, help="prompt tokens a step must carry to set the prompt rate")
    ap.add_argument("--goal", type=float, default=None, help="output tok/s to compare with")
    ap.add_argument("--out", type=Path, default=None, help="write the figures as JSON")
    args = ap.parse_args()
    runs = load_runs(args.trace, args.gap_ms)
    run = runs[args.run] if args.run is not None else max(runs, key=len)
    res = floor(run, args.chunk, args.goal)
    res["runs_in_trace"] = len(runs)
    print(table(res))
    if args.out:
        args.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
