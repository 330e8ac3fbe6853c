"""``--step-time-target-ms`` in simulation: the real ``Batcher`` and ``StepModel`` against a worker whose steps cost
what a cost model says, on a simulated clock (no GPU, seconds of CPU). W5's shape: Poisson arrivals, prompts
256–2,048 tokens, answers 64–512; the default costs are the H200's for the 8B shape (W5's decode graphs ~5.3 ms at
~16 rows; ~18.6 µs a prompt token) plus ``--fixed`` ms for any step with prompt tokens (W5's mixed steps take
~21 ms of the worker's host time to queue: a step with prompt tokens is dearer than its tokens).

Per configuration (target off; the target with the served model — four terms, the queue floor; and, to show what
each part does, without the queue floor and with three terms as before 2026-12-04): TTFT and ITL p50/p99, the
longest queue, the steps and the simulated duration. Steps run one after the other (no overlap: a step's results
before the next is built), so the figures are a policy's, not a promise of the server's.

    python -m benchmarks.sim_step_target --rate 4 --requests 200 --target 12 --out /tmp/sim.json

Prints a table last; writes JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import deque
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.scheduler.batcher import Batcher, Limits  # noqa: E402
from services.scheduler.kv import KVManager  # noqa: E402
from services.scheduler.policy import POLICIES  # noqa: E402
from services.scheduler.request import Req, Status  # noqa: E402
from services.scheduler.step_model import DRAIN_STEPS, StepModel  # noqa: E402
from shared.messages.common import SamplingParams  # noqa: E402


def workload(n: int, rate: float, seed: int) -> list[tuple[float, int, int]]:
    """(arrival s, prompt tokens, answer tokens) of ``n`` requests: Poisson at ``rate`` a second, W5's lengths."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1 / rate, n))
    return [(float(a), int(rng.integers(256, 2049)), int(rng.integers(64, 513))) for a in arrivals]


def simulate(reqs: list[tuple[float, int, int]], target: float, cost: dict, drain: bool = True,
             four_terms: bool = True, pool: int = 1 << 20) -> dict:
    """Serve ``reqs`` on a simulated clock → latencies (ms) and counts."""
    b = Batcher(KVManager(pool, 512), POLICIES["fcfs"](), Limits(512, 16384, 16384, step_target_ms=target))
    b.step_model = StepModel(drain_steps=DRAIN_STEPS if drain else 1 << 40)
    if not four_terms:  # (the model before the fixed term: its prior pinned at zero, never updated)
        b.step_model.theta[3], b.step_model.cov[3, 3] = 0.0, 0.0
    return _serve(b, reqs, cost)


def _serve(b: Batcher, reqs: list[tuple[float, int, int]], cost: dict) -> dict:
    todo = deque(reqs)
    running: list[Req] = []
    waiting: deque[Req] = deque()
    t, last, first, itl, arrived = 0.0, {}, {}, [], {}
    steps, longest, token = 0, 0, 10
    while todo or waiting or running:
        while todo and todo[0][0] <= t:
            at, p, o = todo.popleft()
            r = Req(rid=f"r{len(arrived)}", replica=b"s", prompt=list(range(token, token + p)),
                    params=SamplingParams(max_new_tokens=o))
            token += p
            arrived[r.rid] = at
            waiting.append(r)
        longest = max(longest, len(waiting))
        s = b.build(running, waiting)
        if s is None:
            t = todo[0][0] if todo else t
            continue
        rows = s.num_tokens - s.prefill_tokens
        ms = (cost["base"] + cost["row"] * rows + cost["token"] * s.prefill_tokens
              + (cost["fixed"] if s.prefill_tokens else 0.0))
        b.step_model.observe(rows, s.prefill_tokens, ms)
        t += ms / 1e3
        steps += 1
        for r, n, sample in zip(s.reqs, s.extend, s.emits):
            if n > 1 or not r.output:
                b.kv.cache_prefix(r)
            if not sample:
                continue
            r.pending -= 1
            r.output.append(7)
            if r.rid in last:
                itl.append((t - last[r.rid]) * 1e3)
            else:
                first[r.rid] = (t - arrived[r.rid]) * 1e3
            last[r.rid] = t
            if r.remaining_new_tokens <= 0:
                running.remove(r)
                b.kv.release(r)
                r.status = Status.FINISHED
    ttft = np.array(list(first.values()))
    itl_a = np.array(itl)
    pct = lambda a, q: round(float(np.percentile(a, q)), 1)  # noqa: E731
    return {"ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99), "itl_p50": pct(itl_a, 50),
            "itl_p99": pct(itl_a, 99), "longest_queue": longest, "steps": steps, "duration_s": round(t, 2)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, default=4.0)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--target", type=float, default=12.0)
    ap.add_argument("--base", type=float, default=4.7, help="ms a step")
    ap.add_argument("--row", type=float, default=0.035, help="ms a decode row")
    ap.add_argument("--token", type=float, default=0.0186, help="ms a prompt token")
    ap.add_argument("--fixed", type=float, default=8.0, help="ms more for a step with prompt tokens")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("/tmp/sim_step_target.json"))
    args = ap.parse_args(argv)
    cost = {"base": args.base, "row": args.row, "token": args.token, "fixed": args.fixed}
    reqs = workload(args.requests, args.rate, args.seed)
    configs = {"off": dict(target=0.0), "target": dict(target=args.target),
               "target, no queue floor": dict(target=args.target, drain=False),
               "target, three terms, no queue floor": dict(target=args.target, drain=False, four_terms=False)}
    t0 = time.perf_counter()
    rows = {name: simulate(reqs, **kw, cost=cost) for name, kw in configs.items()}
    out = {"rate": args.rate, "requests": args.requests, "target_ms": args.target, "cost_ms": cost,
           "cpu_s": round(time.perf_counter() - t0, 1), "results": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    print(f"## {args.requests} requests at {args.rate} req/s, target {args.target} ms; step ms = {args.base} + "
          f"{args.row} × rows + {args.token} × prompt tokens (+ {args.fixed} with prompt tokens)")
    print("| configuration | TTFT p50 / p99 ms | ITL p50 / p99 ms | ITL p99 ÷ p50 | longest queue | steps | s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, r in rows.items():
        print(f"| {name} | {r['ttft_p50']} / {r['ttft_p99']} | {r['itl_p50']} / {r['itl_p99']} | "
              f"{r['itl_p99'] / max(r['itl_p50'], 1e-9):.1f} | {r['longest_queue']} | {r['steps']} | "
              f"{r['duration_s']} |")
    print(f"\nJSON: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
