"""Where a prefill step's device time goes (issue 18: W2's mixed steps run ~23 µs a prompt token, ~620
TFLOP/s of the model's GEMMs). Two parts:

1. The model's prefill, ``--rows`` × ``--length`` tokens a step, eagerly under ``torch.profiler`` through
   ``ModelRunner`` (no server): kernels grouped as ``decode_profile`` groups them, µs a step and a prompt token.
2. The layer's GEMM shapes alone at M = rows × length (q/k/v, o, gate/up, down), timed with CUDA events on
   cuBLAS and on cuBLASLt (``torch.backends.cuda.preferred_blas_library``): TFLOP/s each. With
   ``-- --quantization fp8`` also the served FP8 linear at those shapes (``quant.fp8.library_fp8_linear``: the
   activations quantized per token, then row-wise ``torch._scaled_mm``), its activation quantization alone, and the
   linear with fast accumulation (``BANYAN_FP8_FAST_ACCUM``).

    python -m benchmarks.gpu.prefill_profile --model /tmp/llama8b --rows 8 --length 2048 --out $OUT/prefill.json
    python -m benchmarks.gpu.prefill_profile --rows 3 --length 2048 --decode-rows 525 --out D   # a W2 mixed step

Prints a table last; writes JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.driver import Driver  # noqa: E402
from benchmarks.gpu.decode_profile import kernel_table, worker_extra  # noqa: E402
from benchmarks.gpu.overlap_probe import time_ms  # noqa: E402
from services.worker.runner import ModelRunner  # noqa: E402
from shared.config import WorkerConfig  # noqa: E402


def profile_prefill(driver: Driver, prompts: list[list[int]], steps: int, decoders: list[str] = ()) -> dict:
    """Kernels of ``steps`` prefill steps of ``prompts`` (released after each), each with a decode token of every
    request in ``decoders`` first (a mixed step, as the scheduler orders one) → groups and heaviest kernels."""
    from torch.profiler import ProfilerActivity, profile

    def step(k: int) -> None:
        rids = [f"p{k}_{i}" for i in range(len(prompts))]
        driver.run([(r, [7], True) for r in decoders] + [(r, p, True) for r, p in zip(rids, prompts)])
        for r in rids:
            driver.release(r)

    for k in range(2):
        step(-1 - k)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for k in range(steps):
        step(k)
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t) / steps * 1e3
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for k in range(steps):
            step(100 + k)
        torch.cuda.synchronize()
    return {"wall_ms": round(wall_ms, 2), **kernel_table(prof, steps)}


def time_fp8_gemms(m: int, shapes: dict[str, tuple[int, int]]) -> dict:
    """The served FP8 linear (per-token activation quantization + row-wise ``_scaled_mm``) at M = m for each
    (n, k): µs and TFLOP/s, and the activation quantization's own µs."""
    from services.worker.quant import fp8

    res = {}
    for name, (n, k) in shapes.items():
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        wq, ws = fp8.quantize_rows(torch.randn(n, k, device="cuda") * 0.02)
        us = time_ms(lambda: fp8.library_fp8_linear(x, wq, ws), 20) * 1e3
        quant_us = time_ms(lambda: fp8._act_quant(x), 20) * 1e3
        previous = fp8.set_fast_accum(True)
        try:
            fast_us = time_ms(lambda: fp8.library_fp8_linear(x, wq, ws), 20) * 1e3
        finally:
            fp8.set_fast_accum(previous)
        res[name] = {"n": n, "k": k, "us": round(us, 1), "tflops": round(2 * m * n * k / us / 1e6, 1),
                     "act_quant_us": round(quant_us, 1), "fast_accum_us": round(fast_us, 1)}
    return res


def time_gemms(m: int, shapes: dict[str, tuple[int, int]], dtype: torch.dtype, reps: int = 20) -> dict:
    """TFLOP/s of x[m, k] @ w[n, k]^T for each (n, k) shape, per BLAS library torch offers here."""
    out: dict[str, dict] = {}
    for lib in ("cublas", "cublaslt"):
        try:
            torch.backends.cuda.preferred_blas_library(lib)
        except Exception as e:  # (a build without the choice)
            out[lib] = {"error": str(e)[:200]}
            continue
        res = {}
        for name, (n, k) in shapes.items():
            x = torch.randn(m, k, device="cuda", dtype=dtype)
            w = torch.randn(n, k, device="cuda", dtype=dtype) * 0.02
            us = time_ms(lambda: torch.nn.functional.linear(x, w), reps) * 1e3
            res[name] = {"n": n, "k": k, "us": round(us, 1), "tflops": round(2 * m * n * k / us / 1e6, 1)}
        out[lib] = res
    torch.backends.cuda.preferred_blas_library("cublas")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="/tmp/llama8b")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--decode-rows", type=int, default=0, help="decoding requests in each step (W2's mixed steps: "
                    "~525 of ~1,500 tokens beside ~6k prompt tokens)")
    ap.add_argument("--decode-context", type=int, default=1536, help="their context at the start")
    ap.add_argument("--out", type=Path, default=Path("/tmp/prefill_profile.json"))
    ap.add_argument("worker_args", nargs="*", help="WorkerConfig fields as --name value (after --)")
    args = ap.parse_args()
    extra = worker_extra(args.worker_args)
    tokens = args.rows * args.length
    kv_need = 3 * tokens + args.decode_rows * (args.decode_context + 4 * args.steps + 16)
    runner = ModelRunner(WorkerConfig(model=args.model, device="cuda",
                                      context_length=max(4096, args.length + 8, args.decode_context + 64),
                                      max_total_tokens=max(300_000, kv_need),
                                      **extra), args.model)
    spec = runner.spec
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, spec.vocab_size, (args.length,), generator=g).tolist() for _ in range(args.rows)]
    driver = Driver(runner, max_rows=args.rows + args.decode_rows + 1)
    decoders = [f"d{i}" for i in range(args.decode_rows)]
    per = max(1, 16384 // args.decode_context)  # (their prompts, ~16k tokens a step)
    for i in range(0, len(decoders), per):
        driver.run([(r, torch.randint(0, spec.vocab_size, (args.decode_context,), generator=g).tolist(), True)
                    for r in decoders[i:i + per]])
    prof = profile_prefill(driver, prompts, args.steps, decoders)
    cfg = json.loads((Path(args.model) / "config.json").read_text())
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    hd = cfg.get("head_dim", h // heads)
    shapes = {"qkv": ((heads + 2 * kv) * hd, h), "o": (h, heads * hd), "gate_up": (2 * inter, h), "down": (h, inter)}
    del runner, driver
    torch.cuda.empty_cache()
    gemms = time_gemms(tokens, shapes, torch.bfloat16)
    if extra.get("quantization") == "fp8":
        gemms["fp8_served"] = time_fp8_gemms(tokens, shapes)
    layers = cfg["num_hidden_layers"]
    out = {"model": args.model, "worker_args": args.worker_args, "rows": args.rows, "length": args.length,
           "decode_rows": args.decode_rows, "decode_context": args.decode_context,
           "tokens": tokens, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "date": time.strftime("%Y-%m-%d %H:%M"), "prefill": prof, "gemms": gemms}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    print(f"## prefill {args.rows} × {args.length} = {tokens} tokens"
          f"{f' beside {args.decode_rows} decodes of ~{args.decode_context}' if args.decode_rows else ''}: "
          f"{prof['wall_ms']} ms wall a step "
          f"({prof['wall_ms'] / tokens * 1e3:.2f} µs a token), {prof['us_per_step'] / 1e3:.1f} ms in kernels")
    print("| group | kernels a step | ms a step | µs a token |\n| --- | ---: | ---: | ---: |")
    for name, v in prof["groups"].items():
        us = v["us_per_step"]
        print(f"| {name} | {v['kernels_per_step']} | {us / 1e3:.1f} | {us / tokens:.2f} |")
    for k in prof["top"][:12]:
        print(f"  {k['per_step']:6.1f} × {k['name'][:100]}: {k['us_per_step'] / 1e3:.2f} ms")
    print(f"\n| GEMM (M = {tokens}) | n × k | cuBLAS µs (TFLOP/s) | cuBLASLt µs (TFLOP/s) | "
          f"× {layers} layers, ms |")
    print("| --- | --- | ---: | ---: | ---: |")
    for name, (n, k) in shapes.items():
        c, lt = gemms.get("cublas", {}).get(name, {}), gemms.get("cublaslt", {}).get(name, {})
        best = min(v.get("us", 1e12) for v in (c, lt))
        print(f"| {name} | {n} × {k} | {c.get('us')} ({c.get('tflops')}) | {lt.get('us')} ({lt.get('tflops')}) | "
              f"{best * layers / 1e3:.1f} |")
    if "fp8_served" in gemms:
        print(f"\n| FP8 linear as served (M = {tokens}) | µs (TFLOP/s) | of which activation quantization µs | "
              f"÷ best bf16 | with fast accumulation µs |\n| --- | ---: | ---: | ---: | ---: |")
        for name, v in gemms["fp8_served"].items():
            best = min(g.get(name, {}).get("us", 1e12) for g in (gemms.get("cublas", {}), gemms.get("cublaslt", {})))
            print(f"| {name} | {v['us']} ({v['tflops']}) | {v['act_quant_us']} | {v['us'] / best:.2f} | "
                  f"{v['fast_accum_us']} |")
    print(f"\nJSON: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
