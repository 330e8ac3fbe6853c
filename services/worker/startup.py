"""The worker's start-up, after the weights are loaded and before the KV pool is sized: which kernels a step runs,
decided once, in this order (``choose_kernels``; each step's result is logged under ``kernels`` in the
``model_loaded`` line, and its time under ``startup_s``):

1. ``fp8_kernels`` (FP8 weights or an FP8 pool; CUDA): ``torch._scaled_mm`` and fast accumulation, the per-token
   quantization, the quantized KV write, the quantizing norm / activation (``quant.enable_cuda_kernels``);
2. ``tune_small_m`` (CUDA, bf16/fp16 activations): the decode-size linear kernel per weight shape and M range
   (``kernels/small_m.py``, ``gemv.cu``);
3. ``tune_gemm`` (CUDA): our GEMM above those rows, per shape and range (``kernels/gemm.py``);
4. ``kv_store_plain``, ``rope_store`` (CUDA): a bf16/fp16 pool's K/V write in one launch; the rope and the K/V write
   in one launch (``kernels/rope_store.py``);
5. ``rope_decode`` (CUDA, the Triton decode): the rope and the K/V write inside the decode attention;
6. ``norm`` (CUDA): our add-RMSNorm for rows <= 8 (``norm.cu``).

The tunings first (they time the linears against the library, which the later checks do not change); each check
runs where its kernel agrees with the reference on the device, else the reference path stays. The tunings' decisions
are kept on disk (``kernels/tuning_cache.py``) and loaded by the next start on the same card and libraries. After
this come the KV pool (sized on what the weights and the tunings left), the attention backend, the decode graphs
and the piecewise graphs (``runner.py``)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from shared import knobs
from services.worker import kernels
from services.worker.attention import decode_rope
from services.worker.kernels.ops import current_ops
from services.worker.numerics import FP8
from services.worker.quant import enable_cuda_kernels, enable_plain_kv_store, fp8 as fp8_path
from services.worker.quant.fp8 import library_fp8_linear


def choose_kernels(model: torch.nn.Module, device: torch.device, dtype: torch.dtype, fp8_paths: bool,
                   small_m: bool, lap: Callable[[str], None]) -> dict:
    """Run the start-up steps (the table above) in order → what each chose (the ``kernels`` of ``model_loaded``).
    ``fp8_paths``: FP8 weights or an FP8 pool; ``small_m``: the decode-size linear kernel allowed
    (``--disable-small-m-kernel`` off); ``lap(name)`` closes a timed phase. Nothing on the CPU."""
    chosen: dict = {}
    if device.type == "cuda" and fp8_paths:
        chosen = enable_cuda_kernels(device)
    lap("kernels")
    if device.type != "cuda":
        return chosen
    if small_m:
        chosen["small_m"] = tune_small_m(model, dtype)
        lap("tune_small_m")
    chosen["gemm"] = tune_gemm(model, dtype)
    lap("tune_gemm")
    chosen["kv_store_plain"] = enable_plain_kv_store(device)
    chosen["rope_store"] = enable_rope_store(device)
    chosen["rope_decode"] = decode_rope.enable_rope(device, dtype)
    chosen["norm"] = enable_cuda_norm(device)
    torch.cuda.empty_cache()  # (the tunings' weight copies and activations: free for the pool's sizing)
    lap("kernels")
    return chosen


def tune_small_m(model: torch.nn.Module, dtype: torch.dtype) -> dict[str, str] | str:
    """Measure the small-M kernel against the library for each linear weight shape of ``model`` (on
    its CUDA device) and use it where it wins → what was chosen, per shape (logged at start-up)."""
    if dtype not in (torch.bfloat16, torch.float16):
        return f"not used with {dtype} activations"  # (its tensor-core dot would round float32 as TF32)
    try:
        from services.worker.kernels import small_m  # noqa: F401 (Triton: the kernels' module)
    except ImportError as e:  # (Triton not installed: the library path)
        return f"unavailable: {e}"
    try:
        return small_m_tune_model(model, dtype)
    except Exception as e:  # a compiler or driver problem: the library path, which is correct
        kernels.reset()
        return f"failed: {type(e).__name__}: {e}"[:300]


def tune_gemm(model: torch.nn.Module, dtype: torch.dtype) -> dict[str, str] | str:
    """Our GEMM (``gemm.py``) against the library (``torch._scaled_mm`` for FP8 weights, cuBLAS for bf16/fp16 up to
    ``gemm.PLAIN_MAX_M`` rows) for each linear shape of ``model`` by range of M; used where it wins → what was chosen
    (logged). The ``gemm`` knob: ``0`` not tried, ``fp8`` FP8 weights only."""
    mode = knobs.get("gemm")
    if mode == "0":
        return "off (BANYAN_GEMM=0)"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"not used with {dtype} activations"  # (its tensor-core dot would round float32 as TF32)
    try:
        return gemm_tune_model(model, dtype, fp8_only=mode == "fp8") or "no linears"
    except Exception as e:  # no Triton, a compiler or driver problem: the library, which is correct
        kernels.gemm_choices.clear()
        return f"failed: {type(e).__name__}: {e}"[:300]


def enable_rope_store(device: torch.device) -> str:
    """The fused rope + K/V write for the pools of this process where it agrees with the two steps
    it replaces on ``device`` → what the layers use (logged)."""
    from services.worker.quant import kv

    kv.set_rope_store_kernel(None)
    try:
        from services.worker.kernels import rope_store

        if rope_store.check(device):
            kv.set_rope_store_kernel(rope_store.rope_store)
            return "triton"
        return "rope, then the write (the fused kernel disagreed with them)"
    except Exception as e:  # no Triton, a compiler problem: the two steps are correct
        return f"rope, then the write ({type(e).__name__}: {e})"[:300]


def enable_cuda_norm(device: torch.device) -> str:
    """Our add-RMSNorm kernel (``norm.cu``) for decode-size rows (M ≤ 8) of this process's FlashInfer
    ops where it agrees with the PyTorch reference on ``device`` → what the norms use (logged).
    The ``cuda_norm`` knob off: FlashInfer's."""
    from services.worker.kernels import ops

    ops.set_small_norm(None)
    if not knobs.get("cuda_norm"):
        return "flashinfer (BANYAN_CUDA_NORM=0)"
    try:
        from services.worker.kernels import cuda_gemv

        g = torch.Generator(device="cpu").manual_seed(0)
        for m, k in ((1, 4096), (3, 5120), (8, 128)):
            x, r = (torch.randn(m, k, generator=g).bfloat16().to(device) for _ in range(2))
            w = (1 + torch.randn(k, generator=g) / 4).bfloat16().to(device)
            if not cuda_gemv.norm_supports(x, w):
                return f"flashinfer (ours unavailable: {cuda_gemv.unavailable(True)})"
            want, want_r = ops._torch_fused_add_rmsnorm(x, r, w, 1e-6)
            got, got_r = cuda_gemv.add_rmsnorm(x, r, w, 1e-6)
            plain = cuda_gemv.add_rmsnorm(x, None, w, 1e-6)[0]
            if not (torch.equal(got_r, want_r) and torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2)
                    and torch.allclose(plain.float(), ops._torch_rmsnorm(x, w, 1e-6).float(), rtol=2e-2, atol=2e-2)):
                return "flashinfer (ours disagreed with the reference)"
    except Exception as e:  # no nvcc, a driver problem: FlashInfer's are correct
        return f"flashinfer ({type(e).__name__}: {e})"[:300]

    def small(x, residual, weight, eps):
        if not cuda_gemv.norm_supports(x, weight) or (residual is not None and residual.shape != x.shape):
            return None
        return cuda_gemv.launch_add_rmsnorm(x, residual, weight, eps)

    ops.set_small_norm(small)
    return f"ours up to {cuda_gemv.NORM_MAX_M} rows (norm.cu), flashinfer above"


def small_m_tune_model(model: torch.nn.Module, dtype: torch.dtype) -> dict[str, str]:
    """``small_m.tune`` over the model's linear layers (those with ``quantized()``: weight, scale or None),
    against cuBLAS (bf16/fp16 weights) or the FP8 library path (e4m3 weights); the projections that
    read a SiluAndMul's output (``silu_mul_input``) also with the activation fused in, and those whose output
    goes through one (``silu_mul_output``: gate/up) also with it made as the kernel stores."""
    from services.worker.kernels.small_m import tune

    def by_dtype(weights):
        return ([(w, s) for w, s in weights if w.dtype == FP8],
                [(w, None) for w, s in weights if w.dtype != FP8 and w.dim() == 2])

    mods = [mod for mod in model.modules() if hasattr(mod, "quantized")]
    fp8, plain = by_dtype([mod.quantized() for mod in mods])
    fp8_act, plain_act = by_dtype([mod.quantized() for mod in mods if getattr(mod, "silu_mul_input", False)])
    fp8_out, plain_out = by_dtype([mod.quantized() for mod in mods if getattr(mod, "silu_mul_output", False)])
    act = current_ops().silu_and_mul
    with torch.inference_mode():
        report = tune(plain, lambda x, w, s: F.linear(x, w), dtype)
        report.update(tune(fp8, library_fp8_linear, dtype))
        report.update(tune(plain_act, lambda x, w, s: F.linear(x, w), dtype, act))
        report.update(tune(fp8_act, library_fp8_linear, dtype, act))
        report.update(tune(plain_out, lambda x, w, s: F.linear(x, w), dtype, act_out=act))
        report.update(tune(fp8_out, library_fp8_linear, dtype, act_out=act))
    return report


def gemm_tune_model(model: torch.nn.Module, dtype: torch.dtype, fp8_only: bool = False) -> dict[str, str]:
    """``gemm.tune`` over the model's linear layers (``quantized()``: weight, per-row scale or None); with ``fp8_only``
    its e4m3 ones only."""
    from services.worker.kernels.gemm import tune

    weights = [mod.quantized() for mod in model.modules() if hasattr(mod, "quantized")]
    with torch.inference_mode():
        return tune([(w, s) for w, s in weights
                     if w.dim() == 2 and (w.dtype == FP8 and s is not None or not fp8_only and w.dtype == dtype)],
                    dtype, fp8_path.quantize_activation, fp8_path.library_gemm)
