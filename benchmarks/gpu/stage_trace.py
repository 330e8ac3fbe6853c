"""Where a request's first token waited: the stage log lines of a server log (every service writes
``{"event": "stage", ...}`` lines with a wall clock ``t``), joined with the worker's step trace
(``BANYAN_STEP_TRACE``, ``services/worker/step_trace.py``) when one is given.

    python -m benchmarks.gpu.stage_trace OUT/server_w7_priority.log [--steps OUT/steps_w7_priority.jsonl]
        [--priority 1] [--top 8]

Per class of request (priority ≥ ``--priority`` and the rest): received → queued (the tokenizer's
way in: tokenizing, routing, the socket), queued → scheduled (the scheduler's queue), scheduled →
first_token (the steps until its first token is applied), first_token → first_out (back through
the tokenizer's loop), received → first_token and → first_out; p50 / p90 / p99 / max. The tokenizers'
``event_loop_lag`` lines (``shared/loop_lag.py``: a window's wake-ups that were over 5 ms late) are
summed up: a loop that lags delays every request's ``received`` too, unseen by the stage lines.
Then the ``--top`` slowest of the first class, each with the steps the worker answered while it
waited (kind, rows, tokens, device ms): what was in flight when it arrived, and what came before its
own step."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

SEGMENTS = (("received", "queued"), ("queued", "scheduled"), ("scheduled", "first_token"),
            ("first_token", "first_out"), ("received", "first_token"), ("received", "first_out"))


def load_stages(path: Path) -> dict[str, dict]:
    """request id → {stage: wall time, "priority": int, "step": the step that admitted it}."""
    reqs: dict[str, dict] = {}
    for line in path.read_text(errors="replace").splitlines():
        if not line.startswith("{"):
            continue
        try:
            ev = json.loads(line)
        except ValueError:
            continue
        if ev.get("event") != "stage" or "t" not in ev:
            continue
        r = reqs.setdefault(ev["request_id"], {"priority": 0})
        r.setdefault(ev["stage"], ev["t"])  # (first occurrence: a retracted request is scheduled again)
        if ev["stage"] == "queued":
            r["priority"] = ev.get("priority", 0)
        elif ev["stage"] == "worker_admitted":
            r.setdefault("step", ev.get("step"))
    return reqs


def lag_windows(path: Path) -> dict[str, list[dict]]:
    """The ``event_loop_lag`` lines of a log (``shared/loop_lag.py``), by service and pid."""
    by: dict[str, list[dict]] = {}
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("{") and '"event_loop_lag"' in line:
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            by.setdefault(f"{ev.get('service', '?')} {ev.get('pid', '')}".strip(), []).append(ev)
    return by


def loop_lag(path: Path) -> str:
    """The ``event_loop_lag`` lines of the log: windows, the worst p99 and max, by service."""
    by = lag_windows(path)
    if not by:
        return "event loops: no event_loop_lag line (no window with a wake-up over 5 ms late, or an older server)"
    return "\n".join(f"event loop of {name}: {len(evs)} windows with lag; p50 ≤ {max(e['p50_ms'] for e in evs)} · "
                     f"p99 ≤ {max(e['p99_ms'] for e in evs)} · max {max(e['max_ms'] for e in evs)} ms"
                     for name, evs in sorted(by.items()))


def load_steps(path: Path) -> list[dict]:
    steps = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return sorted((s for s in steps if "t" in s), key=lambda s: s["t"])


def quantile(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))] if xs else float("nan")


def segments(reqs: dict[str, dict], min_priority: int) -> str:
    lines = ["| requests | n | " + " | ".join(f"{a} → {b} ms p50 · p90 · p99 · max" for a, b in SEGMENTS) + " |",
             "| --- | ---: |" + " --- |" * len(SEGMENTS)]
    for name, keep in ((f"priority ≥ {min_priority}", lambda r: r["priority"] >= min_priority),
                       (f"priority < {min_priority}", lambda r: r["priority"] < min_priority)):
        rs = [r for r in reqs.values() if keep(r) and "first_token" in r and "received" in r]
        cells = []
        for a, b in SEGMENTS:
            xs = [(r[b] - r[a]) * 1e3 for r in rs if a in r and b in r]
            cells.append(" · ".join(f"{quantile(xs, p):.1f}" for p in (0.5, 0.9, 0.99, 1.0)) if xs else "—")
        lines.append(f"| {name} | {len(rs)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def slowest(reqs: dict[str, dict], steps: list[dict], min_priority: int, top: int) -> str:
    def end(r: dict) -> float:  # (out of the tokenizer where known, else the scheduler's first token)
        return r.get("first_out", r["first_token"])

    rs = sorted(((rid, r) for rid, r in reqs.items() if r["priority"] >= min_priority and "first_token" in r
                 and "received" in r), key=lambda x: end(x[1]) - x[1]["received"], reverse=True)
    out = []
    for rid, r in rs[:top]:
        seg = " · ".join(f"{a}→{b} {(r[b] - r[a]) * 1e3:.1f}" for a, b in SEGMENTS[:4] if a in r and b in r)
        out.append(f"{rid[:12]} first token out {(end(r) - r['received']) * 1e3:.1f} ms ({seg}); "
                   f"admitted in step {r.get('step')}")
        for s in steps:  # (its own step always: the worker stamps ``t`` after sending the step's answer, so on a
            # loaded host the scheduler's first_token can come before it)
            if r["received"] <= s["t"] <= r["first_token"] + 1e-3 or s["step"] == r.get("step"):
                mark = " ← its step" if s["step"] == r.get("step") else ""
                out.append(f"    step {s['step']} {s['kind']} rows {s['rows']} tokens {s['tokens']} device "
                           f"{s['device_ms']:.1f} ms, answered +{(s['t'] - r['received']) * 1e3:.1f} ms{mark}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("log", type=Path, help="a server log (JSON lines; --log-format json or a file)")
    ap.add_argument("--steps", type=Path, default=None, help="the worker's step trace of the same server")
    ap.add_argument("--priority", type=int, default=1, help="the class of requests looked at: priority ≥ this")
    ap.add_argument("--top", type=int, default=8, help="the slowest requests of that class, with their steps")
    a = ap.parse_args(argv)
    reqs = load_stages(a.log)
    print(segments(reqs, a.priority))
    print(loop_lag(a.log))
    print()
    print(slowest(reqs, load_steps(a.steps) if a.steps else [], a.priority, a.top))


if __name__ == "__main__":
    main()
