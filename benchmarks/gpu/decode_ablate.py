"""What the kernels between a decode step's linears cost in the CUDA graph (issue 20: FP8 W1 ≤ 2.6 ms): the
batch-1 (or ``--batch``) decode graph captured again with parts of the layer turned into no-ops, its replay
timed back to back with CUDA events. The outputs of an ablated graph are meaningless; only its time is read.
The difference to ``base`` bounds what fusing that part away could save:

- ``nonorm``: every add-RMSNorm returns its input (no norm kernel: the residual stream is not updated);
- ``noattn``: the attention returns q (no rope, no K/V write, no attention kernel);
- ``nonorm+noattn``: both — the linears (and the embedding, the lm_head) in a chain;
- ``NAME=VALUE`` (joined to the others by ``+``): that environment variable set while the graph is captured
  (a kernel's launch knob, e.g. ``BANYAN_DECODE_MIN_PART=128``, ``BANYAN_L2_ATTN_MIB=16``,
  ``BANYAN_GEMV_L2_CHAIN=8``): a real variant, its outputs valid.

    python -m benchmarks.gpu.decode_ablate --model /tmp/llama8b --out $OUT/ablate.json -- --quantization fp8 \
        --fp8-vocab true

Prints a table last; writes JSON (µs per replay of each variant, their differences to ``base``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.driver import Driver  # noqa: E402
from benchmarks.gpu.decode_profile import worker_extra  # noqa: E402
from services.worker.attention import decode_rules  # noqa: E402
from services.worker.cuda_graph import (  # noqa: E402
    IDS, NUM_INPUTS, OUT_SLOTS, POSITIONS, PREFIX_LENS, ROWS, DecodeGraphs)
from services.worker.kernels import triton_pdl  # noqa: E402
from services.worker.models import ops  # noqa: E402
from services.worker.runner import ModelRunner  # noqa: E402
from shared.config import WorkerConfig  # noqa: E402

VARIANTS = ("base", "nonorm", "noattn", "nonorm+noattn")


def _skip_norm(x, residual, weight, eps):
    return x, (x if residual is None else residual)


def replay_us(runner: ModelRunner, variant: str, inputs: torch.Tensor, reps: int) -> list[float]:
    """Capture the decode graph of ``inputs``' rows with ``variant``'s parts turned off, fill it with ``inputs``
    (the graph's input rows: ids, slots, positions, table rows, prefix lengths) → µs of a replay in each of 5
    rounds of ``reps`` back-to-back replays."""
    bs = inputs.shape[1]
    saved_norm, saved_fwd, saved_try = ops._small_norm, runner.attn.forward, None
    from services.worker import kernels

    env = dict(p.split("=", 1) for p in variant.split("+") if "=" in p)
    saved_env = {k: os.environ.get(k) for k in env}
    try:
        os.environ.update(env)
        triton_pdl._supported.cache_clear()  # (BANYAN_TRITON_PDL and the decode's knobs: read once a process)
        decode_rules.knobs.cache_clear()
        kernels.chain_l2(runner.model, runner.device, runner.attn)  # (the L2 knobs: read when set up)
        if "nonorm" in variant.split("+"):
            ops.set_small_norm(_skip_norm)
            saved_try = kernels.try_norm_linear
            kernels.try_norm_linear = lambda *a, **k: None  # (the norm fused into q/k/v: off as well)
        if "noattn" in variant.split("+"):
            runner.attn.forward = lambda q, k, v, layer, rope=None, written=False: q
        g = DecodeGraphs(runner.model, runner.attn, bs, runner.context_length, runner.device, runner.spec.vocab_size)
        g.inputs[:, :bs].copy_(inputs)
        g.replay(g.batch(runner.req_to_token, bs, inputs[PREFIX_LENS].tolist()))  # (plans the attention too)
        graph = g._graphs[bs]
        times = []
        for _ in range(5):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / reps)
        del g, graph
        return times
    finally:
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        triton_pdl._supported.cache_clear()
        decode_rules.knobs.cache_clear()
        kernels.chain_l2(runner.model, runner.device, runner.attn)
        ops.set_small_norm(saved_norm)
        runner.attn.forward = saved_fwd
        if saved_try is not None:
            kernels.try_norm_linear = saved_try


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="/tmp/llama8b")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", default="256", help="the requests' tokens before the timed step (comma-separated)")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated (see above)")
    ap.add_argument("--out", type=Path, default=Path("/tmp/decode_ablate.json"))
    ap.add_argument("worker_args", nargs="*", help="WorkerConfig fields as --name value (after --)")
    args = ap.parse_args()
    runner = ModelRunner(WorkerConfig(model=args.model, device="cuda", context_length=4096, max_total_tokens=300_000,
                                      **worker_extra(args.worker_args)), args.model)
    if runner.graphs is None:
        print("no decode graphs: nothing to ablate")
        return 1
    runner.graphs = None  # (its graphs' attention buffers are re-made by each variant's capture: steps eager)
    driver = Driver(runner, max_rows=2 * args.batch + 1)
    gen = torch.Generator().manual_seed(0)
    out = {"model": args.model, "worker_args": args.worker_args, "batch": args.batch,
           "device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d %H:%M"), "contexts": {}}
    for ctx in (int(c) for c in args.context.split(",")):
        rids = [f"c{ctx}_{i}" for i in range(args.batch)]
        driver.run([(r, torch.randint(0, runner.spec.vocab_size, (ctx,), generator=gen).tolist(), True)
                    for r in rids])
        driver.run([(r, [7], True) for r in rids])
        reqs = [driver.reqs[r] for r in rids]  # (the graph re-runs that decode step: its token, slot and position)
        inputs = torch.tensor([[7] * len(reqs), [q.slots[-1] for q in reqs], [len(q.slots) - 1 for q in reqs],
                               [q.row for q in reqs], [len(q.slots) - 1 for q in reqs]], device=runner.device)
        assert inputs.shape[0] == NUM_INPUTS and (IDS, OUT_SLOTS, POSITIONS, ROWS, PREFIX_LENS) == tuple(range(5))
        res = out["contexts"][ctx] = {"us": {}, "rounds": {}}
        with torch.inference_mode():
            for v in args.variants.split(","):
                times = replay_us(runner, v, inputs, args.reps)
                res["rounds"][v] = [round(t, 1) for t in times]
                res["us"][v] = round(sorted(times)[len(times) // 2], 1)
                print(f"context {ctx}, {v}: {res['us'][v]} µs (rounds {res['rounds'][v]})", flush=True)
        base = res["us"].get("base")
        res["saved_us"] = {v: round(base - us, 1) for v, us in res["us"].items() if base is not None}
        for r in rids:
            driver.release(r)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    for ctx, res in out["contexts"].items():
        print(f"\n| variant (batch {args.batch}, context {ctx}) | µs a replay | less than base |")
        print("| --- | ---: | ---: |")
        for v, us in res["us"].items():
            print(f"| {v} | {us} | {res['saved_us'].get(v, '')} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
