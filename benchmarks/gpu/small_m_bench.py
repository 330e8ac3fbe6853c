"""Linear layers at decode sizes on one GPU (issue 18: GEMV at ≥ 90 % of copy bandwidth at M = 1–8;
issue 20: FP8 weights at M = 1): for each Llama-3.1-8B weight shape and M in 1, 2, 4, 8, 16, the
time of cuBLAS bf16 (``F.linear``), Banyan's small-M kernel on the bf16 weight, the FP8 library
path (per-token quantization + ``torch._scaled_mm``) and the small-M kernel on the e4m3 weight
(weight-only), as µs, weight GB/s and % of 4.3 TB/s; also what ``tune`` picks per shape. Prints a
table, writes JSON.

    python -m benchmarks.gpu.small_m_bench --out /tmp/banyan-gpu/small_m.json       # ~1 min (compiles)
    python -m benchmarks.gpu.small_m_bench --sweep --ms 1 --out s.json   # FP8 at M = 1: ~90 more configs
    python -m benchmarks.gpu.small_m_bench --library-only --ms 64,128,600 --out l.json   # decode batches: the libraries

``--library-only`` (the M of W2's decode steps, which the small-M kernels do not take): cuBLAS bf16, the served FP8
path, and its ``_scaled_mm`` alone on pre-quantized activations — row-wise scales as served, and tensor-wise
(``scaled_mm_fp8_gemm_rowwise`` / ``_tensorwise``): what the activation quantization costs, and whether another
scaling picks a faster GEMM; and both with fast accumulation (``scaled_mm_fp8_fast``,
``scaled_mm_fp8_gemm_rowwise_fast``: ``BANYAN_FP8_FAST_ACCUM``'s GEMM), and our FP8 GEMM's configs on the same
quantized activations (``w8a8_<config>``, ``kernels/gemm.py``: what its start-up tuning chooses from) and its bf16
configs on the bf16 weight (``bf16_<config>``, against cuBLAS); and the ops before an FP8 linear — add-RMSNorm or
SiLU-and-multiply, then the per-token quantization — against the kernels that quantize as they write.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path[:0] = [str(Path(__file__).resolve().parents[2])]

from services.worker import kernels  # noqa: E402
from services.worker.kernels import small_m as sm  # noqa: E402
from services.worker.kernels import cuda_gemv  # noqa: E402
from services.worker.kernels import gemm as fg  # noqa: E402
from services.worker.quant import enable_cuda_kernels, fp8  # noqa: E402
from services.worker.quant.fp8 import library_fp8_linear, quantize_per_token, quantize_rows  # noqa: E402

HBM = 4.3e12
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}


def copies_of(t: torch.Tensor) -> list[torch.Tensor]:
    """``t`` and clones of it spanning ≥ 256 MB: a timing cycles through them, as a decode step
    reads each layer's weight once (the same weight re-read would be served from the 50 MB L2)."""
    n = max(1, min(16, -(-sm.L2_SPAN // (t.numel() * t.element_size()))))
    return [t] + [t.clone() for _ in range(n - 1)]


def sweep_configs() -> list[sm.Config]:
    """Configs beyond ``sm.CONFIGS`` for the e4m3 weights at M = 1 (``--sweep``): larger tiles (an
    FP8 tile holds half the bf16 tile's bytes, so fewer are in flight per SM at the same shape), more
    warps and stages, CUDA-core tiles of 2–16 rows: which of them, if any, reads nearer bandwidth."""
    dot = [sm.Config(bn, bk, warps=w, stages=4, split=sp, last_adds=sp > 1)
           for bn, bk in ((16, 512), (32, 512), (64, 256), (64, 512), (128, 256)) for w in (4, 8) for sp in (1, 2, 4)]
    fma = [sm.Config(bn, bk, warps=w, stages=st, m_tile=1)
           for bn, bk in ((2, 2048), (4, 2048), (8, 1024), (16, 512), (8, 512)) for w in (2, 4, 8) for st in (2, 4)]
    return [c for c in dot + fma if c not in sm.CONFIGS]


def time_fused_quant(ms: list[int], hidden: int = 4096, inter: int = 14336) -> list[dict]:
    """The ops before an FP8 linear at M rows, µs in CUDA graphs: FlashInfer's add-RMSNorm (or SiLU-and-multiply)
    then the per-token quantization kernel, against our kernel that quantizes as it writes (``FusedQuant``)."""
    import flashinfer.activation
    import flashinfer.norm

    from services.worker.quant import triton_kernels as tk

    out = []
    for m in ms:
        x, r = (torch.randn(m, hidden, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        nw = torch.ones(hidden, device="cuda", dtype=torch.bfloat16)
        h = torch.randn(m, 2 * inter, device="cuda", dtype=torch.bfloat16)

        def norm_then_quant(i):
            flashinfer.norm.fused_add_rmsnorm(x, r, nw, 1e-6)
            return tk.per_token_quant(x)

        out.append({"m": m, "norm_then_quant_us": sm._time(norm_then_quant, 1, reps=20) * 1e6,
                    "norm_quant_us": sm._time(lambda i: tk.add_rmsnorm_quant(x, r, nw, 1e-6), 1, reps=20) * 1e6,
                    "silu_then_quant_us": sm._time(lambda i: tk.per_token_quant(flashinfer.activation.silu_and_mul(h)),
                                                   1, reps=20) * 1e6,
                    "silu_quant_us": sm._time(lambda i: tk.silu_mul_quant(h), 1, reps=20) * 1e6})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="small_m.json")
    ap.add_argument("--ms", default="1,2,4,8,16")
    ap.add_argument("--fp8-only", action="store_true", help="only FP8 weights (and cuBLAS bf16 as the yardstick)")
    ap.add_argument("--sweep", action="store_true", help="FP8 only, with ~90 more configs (sweep_configs), no lm_head")
    ap.add_argument("--library-only", action="store_true", help="cuBLAS bf16 and the FP8 library paths only, no tune")
    ap.add_argument("--only", default="", help="(with --sweep) the configs whose name matches this regex, e.g. 'k2'")
    args = ap.parse_args()
    args.fp8_only |= args.sweep
    cuda = list(cuda_gemv.CONFIGS) if cuda_gemv.library(True) is not None else []  # (gemv.cu, built here)
    print(f"cuda gemv: {'built' if cuda else cuda_gemv.unavailable()}")
    fp8_configs = [] if args.library_only else list(sm.CONFIGS) + cuda + (sweep_configs() if args.sweep else [])
    if args.only:
        fp8_configs = [c for c in fp8_configs if re.search(args.only, str(c))]
    dev = torch.device("cuda")
    print("fp8 kernels:", enable_cuda_kernels(dev))  # (as the worker serves: the Triton per-token quantization)
    g = torch.Generator(device="cpu").manual_seed(0)
    rows, picks = [], {}
    for name, (n, k) in SHAPES.items():
        if args.sweep and name == "lm_head":
            continue
        w = (torch.randn(n, k, generator=g) * 0.02).to(torch.bfloat16).to(dev)
        q, s = (t.to(dev) for t in quantize_rows(w.float().cpu()))
        kernels.reset()
        if not args.library_only:
            picks[name] = {**({} if args.fp8_only else sm.tune([(w, None)], lambda x, w, s: F.linear(x, w),
                                                               torch.bfloat16)),
                           **sm.tune([(q, s)], library_fp8_linear, torch.bfloat16)}
        ws, qs = copies_of(w), copies_of(q)
        for m in (int(v) for v in args.ms.split(",")):
            x = torch.randn(m, k, generator=g).to(torch.bfloat16).to(dev)
            row = {"shape": name, "n": n, "k": k, "m": m}
            gemm_only = []
            if args.library_only:  # (the FP8 GEMM alone on pre-quantized activations, row- and tensor-wise)
                xq, xs = quantize_per_token(x)
                one = torch.ones((), device=dev)

                def gemm(i, sa, sb, fast=False):
                    return torch._scaled_mm(xq, qs[i].t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16,
                                            use_fast_accum=fast)

                def served_fast(i):
                    previous = fp8.set_fast_accum(True)
                    try:
                        return library_fp8_linear(x, qs[i], s)
                    finally:
                        fp8.set_fast_accum(previous)

                gemm_only = [("scaled_mm_fp8_gemm_rowwise", lambda i: gemm(i, xs, s.view(1, n)), q.numel(), len(qs)),
                             ("scaled_mm_fp8_gemm_tensorwise", lambda i: gemm(i, one, one), q.numel(), len(qs)),
                             ("scaled_mm_fp8_gemm_rowwise_fast", lambda i: gemm(i, xs, s.view(1, n), True), q.numel(),
                              len(qs)),
                             ("scaled_mm_fp8_fast", served_fast, q.numel(), len(qs)),
                             *[(f"w8a8_{c}", lambda i, c=c: fg.matmul(xq, qs[i], torch.bfloat16, c, xs, s), q.numel(),
                                len(qs)) for c in fg.CONFIGS],
                             *[(f"bf16_{c}", lambda i, c=c: fg.matmul(x, ws[i], torch.bfloat16, c), w.numel() * 2,
                                len(ws)) for c in fg.PLAIN_CONFIGS]]
            for label, fn, nbytes, copies in (
                    ("cublas_bf16", lambda i: F.linear(x, ws[i]), w.numel() * 2, len(ws)),  # (always: the yardstick)
                    *[(f"kernel_bf16_{c}", lambda i, c=c: sm.linear(x, ws[i], None, c),
                       w.numel() * 2, len(ws)) for c in list(sm.CONFIGS) + cuda
                      if not (args.fp8_only or args.library_only)],
                    ("scaled_mm_fp8", lambda i: library_fp8_linear(x, qs[i], s), q.numel(), len(qs)),
                    *gemm_only,
                    *[(f"kernel_fp8_{c}", lambda i, c=c: sm.linear(x, qs[i], s, c),
                       q.numel(), len(qs)) for c in fp8_configs]):
                try:
                    t = sm._time(fn, copies, reps=20)
                    row[label] = {"us": round(t * 1e6, 2), "gb_s": round(nbytes / t / 1e9, 1),
                                  "of_hbm": round(nbytes / t / HBM, 3)}
                except Exception as e:  # (a config the compiler rejects: recorded, not fatal)
                    row[label] = {"error": f"{type(e).__name__}: {e}"[:200]}
            rows.append(row)
    fused = []
    if args.library_only:
        try:
            fused = time_fused_quant([int(v) for v in args.ms.split(",")])
        except Exception as e:  # (no FlashInfer here: the table says so)
            fused = [{"error": f"{type(e).__name__}: {e}"[:200]}]
    doc = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows, "tune": picks,
           "fused_quant": fused, "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    Path(args.out).write_text(json.dumps(doc, indent=1))

    def best(row, prefix):
        got = [(v["us"], k) for k, v in row.items() if k.startswith(prefix) and isinstance(v, dict) and "us" in v]
        return min(got) if got else (float("nan"), "-")

    print("| shape | M | cuBLAS bf16 µs (% HBM) | best kernel bf16 µs (% HBM) | _scaled_mm FP8 µs | best kernel FP8 µs (% HBM) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        cb, kb, sf, kf = (r["cublas_bf16"], best(r, "kernel_bf16"), r["scaled_mm_fp8"], best(r, "kernel_fp8"))
        pct = lambda v: f"{v['us']:.1f} ({v['of_hbm']:.0%})" if "us" in v else "error"  # noqa: E731
        print(f"| {r['shape']} | {r['m']} | {pct(cb)} | {kb[0]:.1f} ({r.get(kb[1], {}).get('of_hbm', 0):.0%}) | "
              f"{sf.get('us', float('nan')):.1f} | {kf[0]:.1f} ({r.get(kf[1], {}).get('of_hbm', 0):.0%}) "
              f"{kf[1].removeprefix('kernel_fp8_')} |")
    if args.library_only:
        print("\n| shape | M | cuBLAS bf16 µs | FP8 as served µs · fast accum. | its GEMM alone: row-wise · "
              "tensor-wise · row-wise fast µs | our FP8 GEMM, best µs (config) | our bf16 GEMM, best µs (config) |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
        us = lambda r, k: r.get(k, {}).get("us", float("nan"))  # noqa: E731
        for r in rows:
            ours, ours16 = best(r, "w8a8_"), best(r, "bf16_")
            print(f"| {r['shape']} | {r['m']} | {us(r, 'cublas_bf16'):.1f} | {us(r, 'scaled_mm_fp8'):.1f} · "
                  f"{us(r, 'scaled_mm_fp8_fast'):.1f} | {us(r, 'scaled_mm_fp8_gemm_rowwise'):.1f} · "
                  f"{us(r, 'scaled_mm_fp8_gemm_tensorwise'):.1f} · {us(r, 'scaled_mm_fp8_gemm_rowwise_fast'):.1f} | "
                  f"{ours[0]:.1f} ({ours[1].removeprefix('w8a8_')}) | "
                  f"{ours16[0]:.1f} ({ours16[1].removeprefix('bf16_')}) |")
    if fused:
        print("\n| M | add-RMSNorm, then quantization µs | quantized by the norm µs | SiLU-and-multiply (14,336), then "
              "quantization µs | quantized by it µs |\n| ---: | ---: | ---: | ---: | ---: |")
        for f in fused:
            if "error" in f:
                print(f"| {f['error']} | | | | |")
                continue
            print(f"| {f['m']} | {f['norm_then_quant_us']:.1f} | {f['norm_quant_us']:.1f} | "
                  f"{f['silu_then_quant_us']:.1f} | {f['silu_quant_us']:.1f} |")
    print("tune:", json.dumps(picks, indent=1))
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
