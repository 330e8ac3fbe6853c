"""Our own CUDA kernels (Triton), each used only where a start-up check on the device found it
correct and faster than the library path it would replace.

- ``small_m.py``: linear layers at decode batch sizes (weight-streaming, bf16 or weight-only FP8).
- ``gemm.py``: GEMMs above them (decode batches, mixed steps): FP8 on quantized activations, and bf16/fp16 — for
  these also cuBLASLt's other algorithms (``cublaslt.py``, ``lt.cu``).
- ``rope_store.py``: the rotary embedding and the K/V write in one launch.

This module is the light part the layers call on every step (no Triton import: CPU installs may
lack it): which weight shapes use a kernel, as ``small_m.tune`` measured them.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

MAX_M = 16  # rows up to which a linear may take the small-M kernel
BUCKETS = (1, 4, MAX_M)  # M ranges (1, 2–4, 5–16) with a choice of their own, each timed at its top
# (N, K, weight dtype[, "silu_mul"]) → ((top M of a range, small_m.Config or None), ...) rising
choices: dict[tuple[int, int, torch.dtype], tuple] = {}
# what ``small_m.tune`` decided per shape, once per process: every runner of the process (graphs and
# eager steps, a second model) uses the same kernel for a shape, whatever the timing noise of a re-run
tuned: dict[tuple[int, int, torch.dtype], str] = {}


# GEMMs above the small-M rows (``gemm.py``): (N, K, weight dtype) → ((top M of a range, GemmConfig or None), ...)
gemm_choices: dict[tuple[int, int, torch.dtype], tuple] = {}
gemm_tuned: dict[tuple[int, int, torch.dtype], str] = {}


def cdiv(a: int, b: int) -> int:
    """``triton.cdiv`` without its cost: Triton wraps it (and ``next_power_of_2``) as a constexpr function, ~1.9 µs
    a host call (3.6 and 3.9) — several a launch on the eager steps' paths."""
    return -(-a // b)


def pow2_at_least(n: int) -> int:
    """The smallest power of two >= ``n`` (``triton.next_power_of_2`` without its cost; 1 for n <= 1)."""
    return 1 << max(0, n - 1).bit_length()


def reset() -> None:
    """Forget every decision (benchmarks and tests that tune again)."""
    choices.clear()
    tuned.clear()
    norm_fused.clear()
    gemm_choices.clear()
    gemm_tuned.clear()


def try_gemm(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype, xs: torch.Tensor | None = None,
             ws: torch.Tensor | None = None) -> torch.Tensor | None:
    """x @ w^T — (x · xs)(w · ws)^T for e4m3 operands — through our GEMM where ``tune_gemm`` chose it for w's shape
    at x's rows; None: the caller's library call."""
    if not gemm_choices or x.dim() != 2:
        return None
    m = x.shape[0]
    for top, cfg in gemm_choices.get((w.shape[0], w.shape[1], w.dtype), ()):
        if m <= top:
            if cfg is None:
                return None
            from services.worker.kernels.gemm import matmul

            return matmul(x, w, out_dtype, cfg, xs, ws)
    return None


def small_m_config(x: torch.Tensor, w: torch.Tensor, silu_mul: bool = False, act_out: bool = False):
    """The small-M kernel's config for ``x @ w.T`` (with ``silu_mul``: for silu(gate) · up of x =
    [gate | up]; with ``act_out``: for silu(gate) · up of the product, w = [gate | up]) at x's number of
    rows (None: the library path)."""
    if not choices or x.dim() != 2 or x.shape[0] > MAX_M:
        return None
    m = x.shape[0]
    key = (w.shape[0], w.shape[1], w.dtype) + (("silu_mul",) if silu_mul else ()) + (("act_out",) if act_out else ())
    for top, cfg in choices.get(key, ()):
        if m <= top:
            return cfg
    return None


# The add-RMSNorm fused into the linear after it (``enable_norm_linear``): (x, residual or None, norm weight, eps,
# w, scale or None) → (linear output, x + residual); None when off.
_norm_linear: Callable | None = None
NORM_LINEAR_MAX_M = 8
norm_fused: set[tuple[int, int, torch.dtype]] = set()  # weight shapes where the fused norm measured faster


def try_norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                    w: torch.Tensor, scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(rmsnorm(x + residual) · norm_weight @ w.T (× scale), x + residual) in one kernel where the linear runs on
    the CUDA decode kernel at x's size anyway and ``enable_norm_linear`` turned the fusion on; None: the caller's
    norm, then its linear."""
    if _norm_linear is None or x.dim() != 2 or x.shape[0] > NORM_LINEAR_MAX_M:
        return None
    if (w.shape[0], w.shape[1], w.dtype) not in norm_fused:
        return None
    if getattr(small_m_config(x, w), "pipe", None) is None:  # (only a CudaConfig has it: the CUDA kernel's shape)
        return None
    from services.worker.kernels import cuda_gemv

    if x.shape[0] * x.shape[1] > cuda_gemv.NORM_LINEAR_MAX_VALUES:  # (the rest: the linear's own choice checked)
        return None
    return _norm_linear(x, residual, norm_weight, eps, w, scale)


def small_m_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None, cfg,
                   silu_mul: bool = False, act_out: bool = False) -> torch.Tensor:
    from services.worker.kernels.small_m import linear

    return linear(x, w, scale, cfg, silu_mul, act_out)


def try_small_m(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None = None,
                bias: torch.Tensor | None = None, silu_mul: bool = False, act_out: bool = False
                ) -> torch.Tensor | None:
    """``x @ w.T`` (× ``scale`` per row, + ``bias``; with ``silu_mul``, of silu(gate) · up for x =
    [gate | up]; with ``act_out`` (no bias), silu(gate) · up of the product for w = [gate | up]) through
    the small-M kernel where it was chosen for ``w``'s shape at this size; None: the caller's library path."""
    cfg = small_m_config(x, w, silu_mul, act_out)
    if cfg is None or (act_out and bias is not None):
        return None
    y = small_m_linear(x, w, scale, cfg, silu_mul, act_out)
    return y if bias is None else y + bias


def tune_small_m(model: torch.nn.Module, dtype: torch.dtype) -> dict[str, str] | str:
    """Measure the small-M kernel against the library for each linear weight shape of ``model`` (on
    its CUDA device) and use it where it wins → what was chosen, per shape (logged at start-up)."""
    if dtype not in (torch.bfloat16, torch.float16):
        return f"not used with {dtype} activations"  # (its tensor-core dot would round float32 as TF32)
    try:
        from services.worker.kernels import small_m as sm
    except ImportError as e:  # (Triton not installed: the library path)
        return f"unavailable: {e}"
    try:
        return sm.tune_model(model, dtype)
    except Exception as e:  # a compiler or driver problem: the library path, which is correct
        reset()
        return f"failed: {type(e).__name__}: {e}"[:300]


def tune_gemm(model: torch.nn.Module, dtype: torch.dtype) -> dict[str, str] | str:
    """Our GEMM (``gemm.py``) against the library (``torch._scaled_mm`` for FP8 weights, cuBLAS for bf16/fp16 up to
    ``gemm.PLAIN_MAX_M`` rows) for each linear shape of ``model`` by range of M; used where it wins → what was chosen
    (logged). ``BANYAN_GEMM=0``: not tried; ``=fp8``: FP8 weights only."""
    mode = os.environ.get("BANYAN_GEMM", "all")
    if mode == "0":
        return "off (BANYAN_GEMM=0)"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"not used with {dtype} activations"  # (its tensor-core dot would round float32 as TF32)
    try:
        from services.worker.kernels import gemm

        return gemm.tune_model(model, dtype, fp8_only=mode == "fp8") or "no linears"
    except Exception as e:  # no Triton, a compiler or driver problem: the library, which is correct
        gemm_choices.clear()
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
    ``BANYAN_CUDA_NORM=0``: FlashInfer's."""
    from services.worker.models import ops

    ops.set_small_norm(None)
    if os.environ.get("BANYAN_CUDA_NORM", "1") == "0":
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


def enable_norm_linear(device: torch.device, model: torch.nn.Module | None = None,
                       dtype: torch.dtype = torch.bfloat16) -> str | dict[str, str]:
    """The add-RMSNorm in front of a linear fused into the linear's CUDA decode kernel (``cuda_gemv.norm_linear``:
    no norm kernel before q/k/v) where it agrees with the reference on ``device``, for the weight shapes of
    ``model``'s linears that take a norm's output (``norm_input``) where it measured faster than the norm kernel
    then the linear's chosen kernel (``small_m.tune_norm_linear``) → what is used (logged). Only where the linear's
    shape chose the CUDA kernel (``try_norm_linear``). ``BANYAN_FUSED_NORM=0``: never; ``=all``: every such
    shape, untimed."""
    global _norm_linear
    _norm_linear = None
    norm_fused.clear()
    mode = os.environ.get("BANYAN_FUSED_NORM", "1")
    if mode == "0":
        return "off (BANYAN_FUSED_NORM=0)"
    try:
        from services.worker.kernels import cuda_gemv
        from services.worker.models import ops

        g = torch.Generator(device="cpu").manual_seed(1)
        for m, k, n, fp8 in ((1, 4096, 96, True), (3, 512, 40, False), (8, 256, 16, True)):
            x, r = (torch.randn(m, k, generator=g).bfloat16().to(device) for _ in range(2))
            nw = (1 + torch.randn(k, generator=g) / 4).bfloat16().to(device)
            w = (torch.randn(n, k, generator=g) / k**0.5).bfloat16().to(device)
            s = None
            if fp8:
                s = w.float().abs().amax(1) / 448
                w = (w.float() / s[:, None]).to(cuda_gemv.FP8)
            if not cuda_gemv.norm_linear_supports(x, nw, w):
                return f"off (unavailable: {cuda_gemv.unavailable(True)})"
            deq = w.float() * (s[:, None] if s is not None else 1)
            for res in (r, None):
                want_h, want_r = ops._torch_fused_add_rmsnorm(x, res, nw, 1e-6) if res is not None else (
                    ops._torch_rmsnorm(x, nw, 1e-6), x)
                want = want_h.float() @ deq.t()
                got, got_r = cuda_gemv.norm_linear(x, res, nw, 1e-6, w, s)
                if not (torch.equal(got_r, want_r) and torch.allclose(
                        got.float(), want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))):
                    return "off (disagreed with the reference)"
    except Exception as e:  # no nvcc, a driver problem: the norm, then the linear, are correct
        return f"off ({type(e).__name__}: {e})"[:300]
    _norm_linear = cuda_gemv.norm_linear
    if model is None:
        return f"on up to {NORM_LINEAR_MAX_M} rows (no model: no shape yet)"
    if mode == "all":
        for mod in model.modules():
            if getattr(mod, "norm_input", False):
                w = mod.quantized()[0]
                norm_fused.add((w.shape[0], w.shape[1], w.dtype))
        return f"on up to {NORM_LINEAR_MAX_M} rows, every shape on the CUDA kernel (BANYAN_FUSED_NORM=all)"
    try:
        from services.worker.kernels import small_m

        return small_m.tune_norm_linear(model, dtype)
    except Exception as e:  # (a timing failure: apart, as before)
        norm_fused.clear()
        return f"off (timing failed: {type(e).__name__}: {e})"[:300]


def attention_l2(model: torch.nn.Module, attn: object) -> str:
    """Opt-in (``BANYAN_L2_ATTN_MIB=<MiB>``): in decode graphs of up to ``BANYAN_L2_ATTN_ROWS`` (8) rows, each
    layer's Triton decode attention prefetches the first MiB of that layer's o projection weight into L2 once its
    K/V is read — the attention's end (parts stored, counted, merged) is a chain of L2 round trips that leaves HBM
    idle at batch 1, and the o projection is a weight-streaming kernel (FP8 16.8 MB in 7.0 µs on the H200: ~3 µs of
    it ramp and drain). Unmeasured: off by default. Sets ``attn.l2_after`` / ``l2_rows`` (a backend without them:
    nothing) before graphs are captured → what was set."""
    if not hasattr(attn, "l2_after"):
        return "off (no Triton decode)"
    mib, rows = int(os.environ.get("BANYAN_L2_ATTN_MIB", "0") or 0), int(os.environ.get("BANYAN_L2_ATTN_ROWS", "8"))
    after = {}
    for mod in model.modules() if mib > 0 else ():
        if hasattr(mod, "o_proj") and isinstance(getattr(mod, "layer", None), int):
            flat = mod.o_proj.quantized()[0].reshape(-1).view(torch.uint8)  # (contiguous: no copy)
            after[mod.layer] = (flat, min(mib << 20, flat.numel()) // 16 * 16)
    attn.l2_after, attn.l2_rows = after, rows if after else 0
    return f"{len(after)} o projections, {mib} MiB each, graphs up to {rows} rows" if after else "off"


def chain_l2(model: torch.nn.Module, device: torch.device, attn: object = None) -> str:
    """Opt-in (``BANYAN_GEMV_L2_CHAIN=<MiB>``): the linear layers that run on the CUDA decode kernel at
    batch 1, in the model's order (its modules' order is the step's: each layer's q/k/v, o, gate/up, down,
    then the lm_head), each prefetch the next one's first MiB (up to half the L2 cache) into L2 once its own
    loads are issued, for the latency-bound kernels between two linears (norm, rope, attention) to overlap
    them → what was set (logged). Before CUDA graphs are captured: they fix the kernels' arguments. Off by
    default: with 30 MiB links the FP8 batch-1 step measured 7 % slower (docs/perf.md, 2026-12-03 twelfth, the plain
    kernel then; the pipelined kernel, every batch-1 shape's choice since, prefetches its link too — unmeasured).
    Any earlier chain (another model's weights, maybe freed) is dropped. With ``attn``: ``attention_l2`` too."""
    from services.worker.kernels import cuda_gemv

    cuda_gemv.chain([], 0)
    mib = int(os.environ.get("BANYAN_GEMV_L2_CHAIN", "0") or 0)
    after_attn = f"; after the attention: {attention_l2(model, attn)}" if attn is not None else ""
    if mib <= 0:
        return "off" + after_attn
    order = []
    for mod in model.modules():
        if hasattr(mod, "quantized"):
            w = mod.quantized()[0]
            one = torch.empty((1, w.shape[-1]), device="meta")
            silu = getattr(mod, "silu_mul_input", False)
            act = getattr(mod, "silu_mul_output", False)
            cfg = small_m_config(one, w, silu) or small_m_config(one, w, act_out=act) or small_m_config(one, w)
            if isinstance(cfg, cuda_gemv.CudaConfig):
                order.append(w)
    cap = min(mib << 20, torch.cuda.get_device_properties(device).L2_cache_size // 2)
    return f"{cuda_gemv.chain(order, cap)} linears, {cap >> 20} MiB each" + after_attn
