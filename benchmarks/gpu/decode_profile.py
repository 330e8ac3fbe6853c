"""Where a decode step's device time goes, kernel by kernel (issue 18: W1's ~1.1 ms of non-GEMM work
a step). Drives ``ModelRunner`` directly (no server) at the given batch sizes: a 128-token prompt
per request, then decode steps — eagerly under ``torch.profiler`` (every kernel and its launch
visible), and replayed from the CUDA graph (the step's device time as W1 sees it). Kernels are
grouped by what they do (GEMM/GEMV, attention, norm, rope, KV write, activation, sampling, copies,
other) with their count and µs per step.

    python -m benchmarks.gpu.decode_profile --model /tmp/llama8b --batch 1,64 --out $OUT/decode_profile.json
    python -m benchmarks.gpu.decode_profile --model /tmp/llama8b --batch 1 -- --quantization fp8

Prints a table per batch size last; writes JSON (groups, the 40 heaviest kernels, graph replay ms).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.driver import Driver  # noqa: E402
from services.worker.runner import ModelRunner  # noqa: E402
from shared.config import WorkerConfig  # noqa: E402

GROUPS = (  # (group, pattern on the kernel's name), first match wins
    ("rope + kv write", r"rope_store"),
    ("kv write", r"store_kv|index_copy|indexCopy|scatter"),
    ("norm", r"rmsnorm|RMSNorm|norm_kernel"),
    ("rope", r"rope|Rope|[Rr]otary"),
    ("activation", r"silu|act_and_mul|ActAndMul|gelu"),
    ("attention", r"BatchDecode|BatchPrefill|SingleDecode|SinglePrefill|MergeState|merge_state|fmha|[Aa]ttention|"
                   r"_partial_kernel|_merge_kernel"),
    ("gemm/gemv", r"gemm|gemv|Gemm|Gemv|cutlass|cublas|sm90_xmma|nvjet|_linear_kernel|_sum_kernel|scaled_mm|matmul"),
    ("sampling", r"sampling|argmax|ArgMax|topk|TopK|softmax|Softmax|sort|Sort|multinomial|reduce_kernel"),
    ("copies", r"[Cc]opy|memcpy|Memcpy|memset|Memset|fill|Fill"),
)


def group_of(name: str) -> str:
    for group, pattern in GROUPS:
        if re.search(pattern, name):
            return group
    return "other"


def kernel_table(prof, steps: int) -> dict:
    """A ``torch.profiler`` run of ``steps`` steps → its CUDA kernels per step: by group, in all, the heaviest."""
    kernels: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            k = kernels[ev.name]
            k[0] += 1
            k[1] += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
    groups: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for name, (n, us) in kernels.items():
        g = groups[group_of(name)]
        g[0] += n / steps
        g[1] += us / steps
    top = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:40]
    return {"groups": {g: {"kernels_per_step": round(n, 2), "us_per_step": round(us, 1)} for g, (n, us) in
                       sorted(groups.items(), key=lambda kv: -kv[1][1])},
            "kernels_per_step": round(sum(n for n, _ in kernels.values()) / steps, 1),
            "us_per_step": round(sum(us for _, us in kernels.values()) / steps, 1),
            "top": [{"name": name[:160], "group": group_of(name), "per_step": round(n / steps, 2),
                     "us_per_step": round(us / steps, 2)} for name, (n, us) in top]}


def profile_steps(driver: Driver, rids: list[str], steps: int) -> dict:
    """Kernels of ``steps`` eager decode steps of ``rids`` → per-step groups and the heaviest kernels."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            driver.run([(r, [7], True) for r in rids])
        torch.cuda.synchronize()
    return kernel_table(prof, steps)


def profile_graph(driver: Driver, runner: ModelRunner, rids: list[str], steps: int) -> dict | None:
    """Kernels of ``steps`` decode steps replayed from the CUDA graph, as the device ran them: per group,
    µs a step in kernels and in the gaps before them (the previous kernel's end to this one's start, within
    a step: launch latency, ramp-up, the drain the next kernel waits for). None: no graph at this size."""
    from torch.profiler import ProfilerActivity, profile

    if runner.graphs is None or runner.graphs.size_for(len(rids)) is None:
        return None
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            driver.run([(r, [7], True) for r in rids])
            torch.cuda.synchronize()  # (steps apart: a gap before a step's first kernel is the host's)
    evs = sorted(((ev.time_range.start, ev.time_range.end, ev.name) for ev in prof.events()
                  if ev.device_type == torch.autograd.DeviceType.CUDA), key=lambda e: e[0])
    if not evs:
        return {"visible": False}
    groups: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    per_kernel: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    prev_end = None
    for start, end, name in evs:
        gap = start - prev_end if prev_end is not None and 0 <= start - prev_end < 200 else 0.0
        for d in (groups[group_of(name)], per_kernel[name]):
            d[0] += 1
            d[1] += end - start
            d[2] += gap
        prev_end = end
    top = sorted(per_kernel.items(), key=lambda kv: -(kv[1][1] + kv[1][2]))[:40]
    return {"visible": True, "kernels_per_step": round(len(evs) / steps, 1),
            "kernel_us_per_step": round(sum(e - s for s, e, _ in evs) / steps, 1),
            "gap_us_per_step": round(sum(d[2] for d in groups.values()) / steps, 1),
            "groups": {g: {"kernels_per_step": round(n / steps, 2), "us_per_step": round(us / steps, 1),
                           "gap_us_per_step": round(gap / steps, 1)}
                       for g, (n, us, gap) in sorted(groups.items(), key=lambda kv: -(kv[1][1] + kv[1][2]))},
            "top": [{"name": name[:160], "group": group_of(name), "per_step": round(n / steps, 2),
                     "us_per_step": round(us / steps, 2), "gap_us_per_step": round(gap / steps, 2)}
                    for name, (n, us, gap) in top]}


def graph_ms(driver: Driver, runner: ModelRunner, rids: list[str], steps: int) -> float | None:
    """Median wall ms of a decode step that replays the CUDA graph (None: no graph at this size)."""
    if runner.graphs is None or runner.graphs.size_for(len(rids)) is None:
        return None
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        driver.run([(r, [7], True) for r in rids])
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2] * 1e3


def worker_extra(flags: list[str]) -> dict:
    """``--name value`` pairs (after ``--``) → WorkerConfig fields ("true" → True)."""
    extra, it = {}, iter(flags)
    for flag in it:
        name, value = flag.removeprefix("--").replace("-", "_"), next(it, "true")
        extra[name] = True if value == "true" else value
    return extra


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="/tmp/llama8b")
    ap.add_argument("--batch", default="1,64", help="decode batch sizes")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens a request (its context when decoding)")
    ap.add_argument("--out", type=Path, default=Path("/tmp/decode_profile.json"))
    ap.add_argument("worker_args", nargs="*", help="WorkerConfig fields as --name value (after --), e.g. "
                    "--quantization fp8")
    args = ap.parse_args()
    extra = worker_extra(args.worker_args)
    runner = ModelRunner(WorkerConfig(model=args.model, device="cuda", context_length=4096, max_total_tokens=300_000,
                                      **extra), args.model)
    driver = Driver(runner, max_rows=max(int(b) for b in args.batch.split(",")) + 1)
    out = {"model": args.model, "worker_args": args.worker_args, "device": torch.cuda.get_device_name(),
           "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M"), "batches": {}}
    for b in (int(x) for x in args.batch.split(",")):
        rids = [f"b{b}_{i}" for i in range(b)]
        g = torch.Generator().manual_seed(b)
        driver.run([(r, torch.randint(0, runner.spec.vocab_size, (args.prompt,), generator=g).tolist(), True)
                    for r in rids])
        res = {"graph_step_ms": graph_ms(driver, runner, rids, args.steps),
               "graph": profile_graph(driver, runner, rids, args.steps)}
        graphs, runner.graphs = runner.graphs, None  # eager: every kernel launched where the profiler sees it
        for _ in range(3):
            driver.run([(r, [7], True) for r in rids])
        res["eager"] = profile_steps(driver, rids, args.steps)
        runner.graphs = graphs
        del graphs
        for r in rids:
            driver.release(r)
        out["batches"][b] = res
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1))
    for b, res in out["batches"].items():
        e = res["eager"]
        print(f"\n## batch {b}: graph step {res['graph_step_ms'] or float('nan'):.2f} ms wall; eager kernels "
              f"{e['kernels_per_step']} a step, {e['us_per_step'] / 1e3:.2f} ms of device time")
        print("| group | kernels a step | µs a step |\n| --- | ---: | ---: |")
        for g, v in e["groups"].items():
            print(f"| {g} | {v['kernels_per_step']} | {v['us_per_step']} |")
        print("heaviest:", ", ".join(f"{k['name'][:60]} {k['us_per_step']}" for k in e["top"][:8]))
        gr = res.get("graph")
        if gr and gr.get("visible"):
            print(f"\ngraph replay, as the device ran it: {gr['kernels_per_step']} kernels a step, "
                  f"{gr['kernel_us_per_step']} µs in kernels + {gr['gap_us_per_step']} µs in gaps between them")
            print("| group | kernels a step | µs a step | gap µs before them |\n| --- | ---: | ---: | ---: |")
            for g, v in gr["groups"].items():
                print(f"| {g} | {v['kernels_per_step']} | {v['us_per_step']} | {v['gap_us_per_step']} |")
            for k in gr["top"][:14]:
                print(f"  {k['per_step']:6.1f} × {k['name'][:90]}: {k['us_per_step']} µs + gaps {k['gap_us_per_step']}")
        elif gr is not None:
            print("graph replay: its kernels are not visible to the profiler here")
    print(f"\nJSON: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
