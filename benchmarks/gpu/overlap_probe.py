"""Can a step's memory-bound decode attention run beside its compute-bound GEMMs? (issue 18, W2: the run is the
GEMMs' compute for every token plus the KV reads of ~590 running requests, one after the other in each layer —
docs/perf.md, 2026-12-04 twentieth session. Overlapping the two, as NanoFlow does, is the size of change left.)

For each case, a bf16 GEMM of a layer's shape (``M`` tokens × K → N, cuBLAS through ``torch.matmul``) and the
decode attention of ``rows`` × ``context`` (a bf16 pool, page size 1, slots in random order, 8 caches cycled as
layers; FlashInfer's tensor-core decode or the Triton one) are timed, ``--layers`` pairs back to back with CUDA
events, eagerly (stream priorities apply; launches are far shorter than the kernels):

- ``gemm`` and ``attn``: each alone; ``serial``: one after the other on one stream;
- ``parallel``: the attention on a second stream (high priority), the GEMM on the first, joined every pair;
- ``parallel_eq``: the same at equal priority;
- ``green_N`` (``--green N,…``): the attention on the stream of a CUDA green context of N SMs (torch's
  ``GreenContext``; the GEMM anywhere) — NanoFlow's SM partition, one-sided (measured slower on the H200, 2026-12-05).

``saved`` = serial − parallel, ``overlap`` = saved ÷ min(gemm, attn): 1.0 would hide the shorter one entirely; near 0
the two only take turns on the SMs (a GEMM's tiles leave no room for another kernel's blocks).

    python -m benchmarks.gpu.overlap_probe --out $OUT/overlap.json
    python -m benchmarks.gpu.overlap_probe --cases "6000x4096x28672:585x1300,290x4096x28672:290x1300"

Prints a table last; writes JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

HQ, HKV, D, CACHES = 32, 8, 128, 8
# a W2 mixed step's prompt chunk (~6k tokens) beside its ~585 decodes (~1.3k context): the gate/up and the o GEMM; a
# decode-only step split in two halves of 290 rows (two-batch overlap: one half's attention beside the other's GEMM)
CASES = "6000x4096x28672:585x1300,6000x4096x4096:585x1300,290x4096x28672:290x1300,290x14336x4096:290x1300"


def time_ms(fn, reps: int) -> float:
    """ms a call of ``fn`` (the median of 5 rounds of ``reps`` calls)."""
    fn()
    torch.cuda.synchronize()
    rounds = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        rounds.append(start.elapsed_time(end) / reps)
    return sorted(rounds)[2]


def attention(kind: str, rows: int, ctx: int, ws: torch.Tensor):
    """→ fn(i): the decode of ``rows`` × ``ctx`` against cache i (of ``CACHES``)."""
    dev = torch.device("cuda")
    slots = rows * ctx + 1
    caches = [(torch.randn(slots, HKV, D, dtype=torch.bfloat16, device=dev),
               torch.randn(slots, HKV, D, dtype=torch.bfloat16, device=dev)) for _ in range(CACHES)]
    table = (torch.randperm(slots - 1, device=dev)[: rows * ctx].to(torch.int32) + 1).view(rows, ctx)
    q = torch.randn(rows, HQ, D, dtype=torch.bfloat16, device=dev)
    if kind == "triton":
        from services.worker.attention import triton_decode as td

        rows_dev, prefix = torch.arange(rows, device=dev), torch.full((rows,), ctx - 1, device=dev)
        return lambda i: td.decode(q, caches[i][0], caches[i][1], table, rows_dev, prefix, 1 / math.sqrt(D))
    import flashinfer

    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
    indptr = torch.arange(0, (rows + 1) * ctx, ctx, dtype=torch.int32)
    w.plan(indptr, table.flatten(), torch.ones(rows, dtype=torch.int32), HQ, HKV, D, 1,
           q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
    return lambda i: w.run(q, caches[i])


_CONTEXTS: list = []


def green_streams(counts: list[int]) -> dict[int, torch.cuda.Stream]:
    """SM count → the stream of a green context of that many SMs (those torch cannot make: left out, said why)."""
    streams = {}
    for n in counts:
        try:
            from torch.cuda.green_contexts import GreenContext

            ctx = GreenContext.create(num_sms=n, device_id=torch.cuda.current_device())
            streams[n] = ctx.Stream()
            _CONTEXTS.append(ctx)  # (alive as long as the process)
        except Exception as e:
            print(f"green context of {n} SMs: unavailable ({type(e).__name__}: {e})"[:300], flush=True)
    return streams


def probe(m: int, k: int, n: int, rows: int, ctx: int, kind: str, layers: int, ws: torch.Tensor,
          green: dict[int, torch.cuda.Stream] | None = None) -> dict:
    dev = torch.device("cuda")
    x = torch.randn(m, k, dtype=torch.bfloat16, device=dev)
    weights = [torch.randn(n, k, dtype=torch.bfloat16, device=dev) / k ** 0.5 for _ in range(2)]
    attn = attention(kind, rows, ctx, ws)
    main = torch.cuda.current_stream()
    side = {p: torch.cuda.Stream(priority=p) for p in (0, -1)}  # (-1: high priority)

    def gemms():
        for i in range(layers):
            torch.matmul(x, weights[i % 2].t())

    def attns():
        for i in range(layers):
            attn(i % CACHES)

    def serial():
        for i in range(layers):
            attn(i % CACHES)
            torch.matmul(x, weights[i % 2].t())

    def parallel(stream: torch.cuda.Stream):
        def run():
            s = stream
            for i in range(layers):
                s.wait_stream(main)
                with torch.cuda.stream(s):
                    attn(i % CACHES)
                torch.matmul(x, weights[i % 2].t())
                main.wait_stream(s)
        return run

    reps = 3
    res = {"gemm": time_ms(gemms, reps), "attn": time_ms(attns, reps), "serial": time_ms(serial, reps),
           "parallel": time_ms(parallel(side[-1]), reps), "parallel_eq": time_ms(parallel(side[0]), reps)}
    for sms, stream in (green or {}).items():
        res[f"green_{sms}"] = time_ms(parallel(stream), reps)
    res = {key: round(ms * 1e3 / layers, 1) for key, ms in res.items()}  # µs a layer
    best = min(v for key, v in res.items() if key.startswith(("parallel", "green")))
    res["saved"] = round(res["serial"] - best, 1)
    res["overlap"] = round(res["saved"] / max(1e-9, min(res["gemm"], res["attn"])), 3)
    res["gemm_tflops"] = round(2 * m * k * n / (res["gemm"] * 1e-6) / 1e12, 1)
    res["attn_tb_s"] = round(rows * ctx * HKV * D * 2 * 2 / (res["attn"] * 1e-6) / 1e12, 2)
    return {"gemm_shape": [m, k, n], "decode": [rows, ctx], "kernel": kind, **res}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default=CASES, help="MxKxN:ROWSxCONTEXT, comma-separated")
    ap.add_argument("--kernels", default="flashinfer,triton")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--green", default="", help="SM counts of green contexts for the attention, comma-separated")
    ap.add_argument("--out", type=Path, default=Path("/tmp/overlap_probe.json"))
    args = ap.parse_args()
    ws = torch.zeros(512 << 20, dtype=torch.uint8, device="cuda")
    green = green_streams([int(c) for c in args.green.split(",") if c])
    out = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d %H:%M"), "cases": []}
    for case in args.cases.split(","):
        gemm, dec = case.split(":")
        m, k, n = map(int, gemm.split("x"))
        rows, ctx = map(int, dec.split("x"))
        for kind in args.kernels.split(","):
            row = probe(m, k, n, rows, ctx, kind, args.layers, ws, green)
            out["cases"].append(row)
            print(json.dumps(row), flush=True)
            torch.cuda.empty_cache()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    print("\n| GEMM M×K×N | decode rows × context | kernel | GEMM µs (TFLOP/s) | attn µs (TB/s) | serial | "
          "parallel (high · equal priority) | saved | overlap |\n"
          "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in out["cases"]:
        print(f"| {'×'.join(map(str, r['gemm_shape']))} | {r['decode'][0]} × {r['decode'][1]} | {r['kernel']} | "
              f"{r['gemm']} ({r['gemm_tflops']}) | {r['attn']} ({r['attn_tb_s']}) | {r['serial']} | "
              f"{r['parallel']} · {r['parallel_eq']} | {r['saved']} | {r['overlap']} |"
              + "".join(f" green {key[6:]}: {v} |" for key, v in r.items() if key.startswith("green_")))


if __name__ == "__main__":
    main()
