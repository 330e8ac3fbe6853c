"""Where a mixed step's host time goes (issue 18's online goals: W5's mixed steps take ~21 ms of the worker's host
time to queue — piecewise, ~1,150 prompt tokens beside ~16 decodes — against 1.9 ms for a decode graph, and their
device time is ~26 ms: the host nearly sets their pace, and chunking a prompt multiplies it).

Drives ``ModelRunner`` directly (no server) as the worker does: each step one prompt chunk of ``--chunks`` tokens
(a fresh request each time) beside ``--decode-rows`` decoding requests (~``--decode-context`` tokens each), and a
decode-only step for reference. Per chunk size: the host time of ``launch`` (queueing the step: what the worker's
``banyan:worker_step_host_seconds`` measures), the wall time to its results, the device time (``busy_s``) and the
step kind (medians of ``--steps`` rounds taking the cases in turn); then the launches again under ``cProfile``: the
functions with the most own time a step.

    python -m benchmarks.gpu.step_host_profile --model /tmp/llama8b --out $OUT/host.json
    python -m benchmarks.gpu.step_host_profile --chunks 64,1150 --decode-rows 16 -- --decode-attention flashinfer
    BANYAN_SPLIT_MIXED=1024 BANYAN_SPLIT_DECODE=384 python -m benchmarks.gpu.step_host_profile --lanes \
        --decode-rows 590 --decode-context 1300 --chunks 0,2000,3600,6000 --top 0   # W2's plateau, two lanes vs one

``--lanes`` (with a ``BANYAN_SPLIT_*`` knob on): every case twice a round, as two lanes (``split_step.py``) and
whole (the same runner, its lanes put aside) — an A/B of the same steps on the same machine state.

Prints a table and the heaviest functions last; writes JSON. Runs on the CPU too (the torch backend: the tests).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.driver import Driver  # noqa: E402
from benchmarks.gpu.decode_profile import worker_extra  # noqa: E402
from services.worker.runner import ModelRunner  # noqa: E402
from shared.config import WorkerConfig  # noqa: E402


class Steps:
    def __init__(self, driver: Driver, decoders: list[str], vocab: int, seed: int = 0) -> None:
        self.driver, self.decoders, self.n = driver, decoders, 0
        self.g = torch.Generator().manual_seed(seed)
        self.vocab = vocab

    def _batch(self, chunk: int):
        """A token of each decoder, and a new prompt of ``chunk`` tokens unless 0 → (batch, the prompt's id)."""
        work, rid = [(r, [7], True) for r in self.decoders], None
        if chunk:
            self.n += 1
            rid = f"p{self.n}"
            work.append((rid, torch.randint(0, self.vocab, (chunk,), generator=self.g).tolist(), True))
        return self.driver.batch(work), rid

    def one(self, chunk: int, prof: cProfile.Profile | None = None, lanes=None) -> dict:
        """One step (``_batch``) → its times; with ``prof``, its launch profiled; ``lanes``: the runner's two lanes
        (``StepLanes``) for this step, or None (whole)."""
        runner, (b, rid) = self.driver.runner, self._batch(chunk)
        runner.lanes = lanes
        t0 = time.perf_counter()
        if prof is not None:
            prof.enable()
        launched = runner.launch(b)
        if prof is not None:
            prof.disable()
        t1 = time.perf_counter()
        runner.finish(launched)
        t2 = time.perf_counter()
        if rid is not None:
            self.driver.release(rid)
        return {"kind": launched.kind, "host_ms": (t1 - t0) * 1e3, "wall_ms": (t2 - t0) * 1e3,
                "device_ms": runner.busy_s * 1e3}

    def profiled(self, chunk: int, steps: int, top: int) -> list[dict]:
        """``steps`` steps' launches under cProfile → the ``top`` functions by own time, ms a step."""
        prof = cProfile.Profile()
        for _ in range(steps):
            self.one(chunk, prof)
        stats = pstats.Stats(prof).stats  # {(file, line, name): (calls, prim calls, own s, cumulative s, callers)}
        rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
        return [{"function": f"{Path(f).name}:{line}({name})", "calls_per_step": round(v[0] / steps, 1),
                 "own_ms_per_step": round(v[2] / steps * 1e3, 3), "cum_ms_per_step": round(v[3] / steps * 1e3, 3)}
                for (f, line, name), v in rows]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="/tmp/llama8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--decode-rows", type=int, default=16)
    ap.add_argument("--decode-context", type=int, default=1200)
    ap.add_argument("--chunks", default="64,256,1150", help="prompt tokens a step (0: a decode-only step)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--lanes", action="store_true", help="each case as two lanes and whole (a BANYAN_SPLIT_* knob on)")
    ap.add_argument("--out", type=Path, default=Path("/tmp/step_host_profile.json"))
    ap.add_argument("worker_args", nargs="*", help="WorkerConfig fields as --name value (after --)")
    args = ap.parse_args(argv)
    chunks = [int(c) for c in args.chunks.split(",")]
    extra = worker_extra(args.worker_args)
    need = args.decode_rows * (args.decode_context + 8 * args.steps + 64) + 4 * max(chunks) + 1024
    runner = ModelRunner(WorkerConfig(model=args.model, device=args.device,
                                      context_length=max(4096, args.decode_context + max(chunks) + 64),
                                      max_total_tokens=max(need, 65536 if args.device == "cuda" else need),
                                      **extra), args.model)
    driver = Driver(runner, max_rows=args.decode_rows + 2)
    decoders = [f"d{i}" for i in range(args.decode_rows)]
    steps = Steps(driver, decoders, runner.spec.vocab_size)
    lanes = runner.lanes
    if args.lanes and lanes is None:
        raise SystemExit("--lanes: set BANYAN_SPLIT_MIXED and/or BANYAN_SPLIT_DECODE (the runner has no lanes)")
    runner.lanes = None
    per = max(1, 8192 // max(1, args.decode_context))  # (their prompts, a few a step)
    for i in range(0, len(decoders), per):
        driver.run([(r, torch.randint(0, runner.spec.vocab_size, (args.decode_context,), generator=steps.g).tolist(),
                     True) for r in decoders[i : i + per]])
    cases = [(c, on) for c in [0] + [c for c in chunks if c] for on in ((False, True) if args.lanes else (False,))]
    for chunk, on in cases:
        for _ in range(3):  # (warm: plans, graphs of this size, caches)
            steps.one(chunk, lanes=lanes if on else None)
    times: dict[tuple, list[dict]] = {c: [] for c in cases}
    for _ in range(args.steps):  # (the cases in turn: no case gets the machine's state of one stretch of time)
        for chunk, on in cases:
            times[chunk, on].append(steps.one(chunk, lanes=lanes if on else None))
    rows = []
    for chunk, on in cases:
        t = times[chunk, on]
        med = {k: round(statistics.median(x[k] for x in t), 3) for k in ("host_ms", "wall_ms", "device_ms")}
        rows.append({"chunk": chunk, "lanes": on, "kind": t[-1]["kind"], **med,
                     "host_ms_max": round(max(x["host_ms"] for x in t), 3),
                     "top": steps.profiled(chunk, args.steps, args.top) if args.top and not on else []})
    out = {"model": args.model, "worker_args": args.worker_args, "device": args.device,
           "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None, "torch": torch.__version__,
           "decode_rows": args.decode_rows, "decode_context": args.decode_context, "steps": args.steps,
           "lanes": str(lanes.knobs) if lanes is not None else None,
           "date": time.strftime("%Y-%m-%d %H:%M"), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    for row in (r for r in rows if r["top"]):
        print(f"\n### {row['chunk']} prompt tokens beside {args.decode_rows} decodes ({row['kind']}): heaviest "
              "functions, own ms a step (cumulative)")
        for f in row["top"][:12]:
            print(f"  {f['own_ms_per_step']:7.3f} ({f['cum_ms_per_step']:7.3f}) × {f['calls_per_step']:6.1f}  "
                  f"{f['function'][:90]}")
    print("\n| prompt tokens | kind | host ms to queue (max) | wall ms | device ms |\n| ---: | --- | ---: | ---: | ---: |")
    for row in rows:
        print(f"| {row['chunk']} | {row['kind']} | {row['host_ms']:.2f} ({row['host_ms_max']:.2f}) | "
              f"{row['wall_ms']:.2f} | {row['device_ms']:.2f} |")
    if args.lanes:  # (two lanes against whole, each case)
        for chunk, _ in cases[::2]:
            a, b = (next(r for r in rows if r["chunk"] == chunk and r["lanes"] == on) for on in (False, True))
            print(f"two lanes, {chunk} prompt tokens: device {b['device_ms']:.2f} vs {a['device_ms']:.2f} ms "
                  f"({b['device_ms'] / max(a['device_ms'], 1e-9) - 1:+.1%}), "
                  f"wall {b['wall_ms']:.2f} vs {a['wall_ms']:.2f}")
    print(f"\nJSON: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
