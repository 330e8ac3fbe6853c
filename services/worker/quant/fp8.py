"""FP8 (e4m3) numerics shared by the weights and the KV cache, in plain PyTorch (any device); the
CUDA kernels that fuse some of them are in ``triton_kernels.py``.

Conventions: a quantized tensor ``q`` and its *dequantization* scale ``s`` stand for ``q * s``
(FP8 checkpoints' ``weight_scale`` and ``k_scale`` / ``v_scale`` mean the same). Values beyond the
format's range saturate at ±448 (a plain cast would make them NaN).

Linear layers (``fp8_linear``): weights (N, K) e4m3 with one scale per output row; activations
quantized per token (row) at run time, x ≈ xq * sx (sx = max|x_row| / 448). On CUDA with bf16/fp16
activations the GEMM is ``torch._scaled_mm`` with row-wise scales on both sides; elsewhere (the
CPU, odd shapes) the same quantized operands are dequantized and multiplied in fp32, so CPU tests
see the GPU path's quantization error.

Two things the library path may do differently (``BANYAN_FP8_FAST_ACCUM``, ``BANYAN_FP8_FUSED_QUANT``, read once):

- fast accumulation (``use_fast_accum``: Hopper's FP8 tensor cores accumulate at reduced precision, without the
  periodic promotion to fp32 — what vLLM's and FBGEMM's FP8 GEMMs run); on by default (``=0``: promoted), measured
  2026-12-05 on an H100: W2 with FP8 weights 6,390 → 6,845 output tok/s (1.24× → 1.32× bf16's), top-1 agreement
  with bf16 0.9971 (0.9986 promoted, on the H200), logits' error vs bf16 0.0335 (0.0330);
- the activations quantized by the op that makes them (``QuantizedActivation``: the add-RMSNorm before q/k/v and
  gate/up, the SiLU-and-multiply before down — one kernel each in place of that op and a quantization pass,
  ``set_fused_quant``); on by default where the kernels check out at start-up, only where the linear takes the
  library path at that batch size (the small-M kernels read unquantized activations).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from shared import knobs
from services.worker import kernels
from services.worker.numerics import FP8, FP8_MAX, fast_accum, set_fast_accum  # noqa: F401 (part of the FP8 API)

_TINY = 1e-12  # scale floor: an all-zero row quantizes to zeros
Tensor = torch.Tensor


def quantize(x: Tensor, scale: Tensor | float) -> Tensor:
    """x / scale, saturated, as e4m3 (scale broadcast against x)."""
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8)


def quantize_rows(w: Tensor) -> tuple[Tensor, Tensor]:
    """Per-row (per output channel) quantization of a 2-D tensor → (q (N, K) e4m3, scale (N,) fp32)."""
    scale = (w.float().abs().amax(dim=1) / FP8_MAX).clamp_(min=_TINY)
    return quantize(w, scale[:, None]), scale


def quantize_per_token(x: Tensor) -> tuple[Tensor, Tensor]:
    """Dynamic per-token quantization of activations (T, K) → (q (T, K) e4m3, scale (T, 1) fp32)."""
    scale = (x.abs().amax(dim=-1, keepdim=True).float() / FP8_MAX).clamp_(min=_TINY)
    return quantize(x, scale), scale


def dequantize_blocks(q: Tensor, scale: Tensor, block: tuple[int, int]) -> Tensor:
    """A block-wise quantized weight (N, K) with scales (ceil(N/b0), ceil(K/b1)) → fp32 (N, K)."""
    n, k = q.shape
    expected = (-(-n // block[0]), -(-k // block[1]))
    if tuple(scale.shape) != expected:
        raise ValueError(f"block scales of shape {tuple(scale.shape)} for a {n}x{k} weight in {block[0]}x{block[1]} "
                         f"blocks; expected {expected}")
    full = scale.float().repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
    return q.float() * full


@dataclass(frozen=True)
class QuantizedWeight:
    """A checkpoint's FP8 weight (N, K) with its scale: per tensor (1,) or per row (N,)."""

    data: Tensor
    scale: Tensor

    def __post_init__(self) -> None:
        if self.data.dtype != FP8:
            raise ValueError(f"an FP8 checkpoint weight of dtype {self.data.dtype}; expected {FP8}")
        if self.scale.numel() not in (1, self.data.shape[0]):
            raise ValueError(f"weight scale of shape {tuple(self.scale.shape)} for a weight of shape "
                             f"{tuple(self.data.shape)}: expected one per tensor or one per output row")

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def row_scale(self) -> Tensor:
        """(N,) float32."""
        s = self.scale.float().reshape(-1)
        return s.expand(self.data.shape[0]) if s.numel() == 1 else s


def load_fp8_rows(weight: Tensor, scale: Tensor, loaded: Tensor | QuantizedWeight, dst: tuple[int, int],
                  src: tuple[int, int], cols: tuple[int, int] | None = None) -> None:
    """Copy rows ``src`` (start, size) of a checkpoint weight into rows ``dst`` (offset, size) of an
    FP8 parameter and its per-row ``scale``, only columns ``cols`` (start, size) when given (a
    row-parallel shard). An FP8 checkpoint weight is copied as it is; any other is quantized per row
    first — over whole rows, so every tensor-parallel rank gets the same scales."""
    if isinstance(loaded, QuantizedWeight):
        q, s = loaded.data, loaded.row_scale()
    else:
        q, s = quantize_rows(loaded.narrow(0, src[0], src[1]).to(weight.device))
        src = (0, src[1])
    q, s = q.narrow(0, *src), s.narrow(0, *src)
    if cols is not None:
        q = q.narrow(1, *cols)
    w_dst = weight.narrow(0, *dst)
    if w_dst.shape != q.shape:
        raise ValueError(f"checkpoint shard has shape {tuple(q.shape)}, expected {tuple(w_dst.shape)}")
    w_dst.copy_(q)
    scale.narrow(0, *dst).copy_(s)


# --- linear layers -------------------------------------------------------------------------------

ActQuant = Callable[[Tensor], tuple[Tensor, Tensor]]
_act_quant: ActQuant = quantize_per_token  # on CUDA: the Triton kernel once ``enable_cuda_kernels`` checked it
_scaled_mm = True  # off when torch._scaled_mm failed its check on the device (then: dequantize and multiply)


class QuantizedActivation(NamedTuple):
    """Activations (T, K) quantized per token by the op that made them — e4m3 ``q`` and (T, 1) float32
    ``scale`` — for an FP8 linear's GEMM; ``dtype``: what the linear outputs (the unquantized activations')."""

    q: Tensor
    scale: Tensor
    dtype: torch.dtype


@dataclass(frozen=True)
class FusedQuant:
    """The ops that quantize the activations they make: ``add_rmsnorm(x, residual or None, weight, eps)`` →
    (rmsnorm(x + residual) quantized, x + residual) or None where it does not take the shape, and
    ``silu_mul(h)`` → silu(gate) · up of h = [gate | up], quantized. Without kernels (``enable_cuda_kernels``
    found none, or the CPU) the caller's op, then ``quantize_activation``."""

    add_rmsnorm: Callable[[Tensor, Tensor | None, Tensor, float], tuple[QuantizedActivation, Tensor] | None] | None
    silu_mul: Callable[[Tensor], QuantizedActivation] | None


# None: FP8 linears quantize their own input (the ``fp8_fused_quant`` knob off)
_fused: FusedQuant | None = FusedQuant(None, None) if knobs.get("fp8_fused_quant") else None


def set_activation_quant(fn: ActQuant) -> None:
    global _act_quant
    _act_quant = fn


def set_fused_quant(fused: FusedQuant | None) -> None:
    """The ops that quantize as they write (None: off). Layers ask per call (``fused_quant``)."""
    global _fused
    _fused = fused


def fused_quant() -> FusedQuant | None:
    return _fused


def quantize_activation(x: Tensor) -> QuantizedActivation:
    """x (T, K) → its per-token quantization (the Triton kernel on CUDA once checked)."""
    if not x.is_cuda:
        return QuantizedActivation(*quantize_per_token(x), x.dtype)
    return QuantizedActivation(*_act_quant(x), x.dtype)


def check_scaled_mm(device: torch.device) -> bool:
    """``torch._scaled_mm`` with row-wise scales works on ``device`` and agrees with the dequantized
    product; else FP8 linears there dequantize and multiply (correct, slower). Fast accumulation, where on
    (the ``fp8_fast_accum`` knob, by default) and failing here, is turned off (``fast_accum()`` tells)."""
    global _scaled_mm
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(48, 64, generator=g), torch.randn(5, 64, generator=g).bfloat16()
    q, s = quantize_rows(w)
    xa = QuantizedActivation(*quantize_per_token(x), x.dtype)
    want = library_gemm(xa, q, s).float()
    on_device = QuantizedActivation(xa.q.to(device), xa.scale.to(device), x.dtype)
    for fast in (True, False) if fast_accum() else (False,):
        _scaled_mm = True
        set_fast_accum(fast)
        try:
            got = library_gemm(on_device, q.to(device), s.to(device)).float().cpu()
            if ((got - want).norm() / want.norm()) < 1e-2:
                return True
        except Exception:  # an arch or a cuBLAS without FP8 GEMMs (or without fast accumulation for them)
            pass
    _scaled_mm = False
    return False


def fp8_linear(x: Tensor | QuantizedActivation, weight: Tensor, scale: Tensor, bias: Tensor | None) -> Tensor:
    """y = x W^T (+ b) with W ≈ weight * scale[:, None] (weight (N, K) e4m3, scale (N,) fp32) and x
    quantized per token (or already, a ``QuantizedActivation``); x (T, K) → y (T, N) in x's dtype. At decode
    sizes, for weight shapes where it measured faster at start-up, Banyan's kernel instead
    (``kernels/small_m.py``: weight-only, x unquantized, or FP8 tensor cores with x quantized per K tile)."""
    if isinstance(x, QuantizedActivation):
        return scaled_gemm(x, weight, scale, bias)
    y = kernels.try_small_m(x, weight, scale, bias)
    return y if y is not None else library_fp8_linear(x, weight, scale, bias)


def _gemm_on_device(x: Tensor, weight: Tensor, dtype: torch.dtype) -> bool:
    n, k = weight.shape
    return x.is_cuda and _scaled_mm and dtype in (torch.bfloat16, torch.float16) and n % 16 == 0 and k % 16 == 0


def takes_quantized(x: Tensor, weight: Tensor) -> bool:
    """Whether the library path would quantize ``x`` for ``weight`` itself, so that the op making x may instead
    (fused quantization on): the GEMM's conditions on CUDA; on the CPU always (its dequantizing path is the same
    math, so CPU tests run the fused path's plumbing bit for bit)."""
    return _fused is not None and x.dim() == 2 and (not x.is_cuda or _gemm_on_device(x, weight, x.dtype))


def scaled_gemm(xa: QuantizedActivation, weight: Tensor, scale: Tensor, bias: Tensor | None = None) -> Tensor:
    """The FP8 GEMM on activations already quantized: ours where it measured faster at start-up
    (``kernels/gemm.py``), else the library's (``library_gemm``)."""
    y = kernels.try_gemm(xa.q, weight, xa.dtype, xa.scale, scale) if xa.q.is_cuda else None
    if y is None:
        y = library_gemm(xa, weight, scale)
    return y if bias is None else y + bias


def library_gemm(xa: QuantizedActivation, weight: Tensor, scale: Tensor) -> Tensor:
    """``torch._scaled_mm`` on CUDA (row-wise scales both sides), else dequantize and multiply."""
    xq, xs = xa.q, xa.scale
    if _gemm_on_device(xq, weight, xa.dtype):
        return torch._scaled_mm(xq, weight.t(), scale_a=xs, scale_b=scale.view(1, weight.shape[0]),
                                out_dtype=xa.dtype, use_fast_accum=fast_accum())
    return F.linear(xq.float() * xs, weight.float() * scale[:, None]).to(xa.dtype)


def library_fp8_linear(x: Tensor, weight: Tensor, scale: Tensor, bias: Tensor | None = None) -> Tensor:
    """``fp8_linear`` through the libraries: ``torch._scaled_mm`` on CUDA, else dequantize and multiply."""
    if _gemm_on_device(x, weight, x.dtype):
        return scaled_gemm(QuantizedActivation(*_act_quant(x), x.dtype), weight, scale, bias)
    return scaled_gemm(QuantizedActivation(*quantize_per_token(x), x.dtype), weight, scale, bias)
