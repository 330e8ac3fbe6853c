"""The kernels the shared layers call: the PyTorch reference (any device) or FlashInfer's fused
CUDA kernels. One set is chosen when the model is built (``use_ops`` around its construction, see
``loader.load_model``) and each layer binds its functions then: nothing dispatches per call.

FlashInfer is imported only by ``flashinfer_ops()``; CPU installs never have it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

Tensor = torch.Tensor


@dataclass(frozen=True)
class RopeStep:
    """One step's rotation of q and k (T, H, D), shared by all layers: ``apply(q, k)`` → rotated
    (q, k), in place or new tensors; ``cos_sin`` (P, D) float32 [cos | sin] and the tokens'
    ``positions`` (T,) for a kernel that rotates while it does something else (the KV write:
    ``KVPool.store_rope``)."""

    cos_sin: Tensor
    positions: Tensor
    apply: Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]

    def __call__(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        return self.apply(q, k)


@dataclass(frozen=True)
class Ops:
    name: str
    rmsnorm: Callable[[Tensor, Tensor, float], Tensor]  # (x, weight, eps) -> normed x
    # (x, residual, weight, eps) -> (rmsnorm(x + residual), x + residual); may reuse its inputs' memory
    fused_add_rmsnorm: Callable[[Tensor, Tensor, Tensor, float], tuple[Tensor, Tensor]]
    silu_and_mul: Callable[[Tensor], Tensor]  # (T, 2I) -> (T, I)
    # (cos_sin (P, D) float32 [cos | sin], positions (T,), dtype) -> the step's rotation of q and k
    rope: Callable[[Tensor, Tensor, torch.dtype], RopeStep]


# --- PyTorch reference -------------------------------------------------------------------------


def _torch_rmsnorm(x: Tensor, weight: Tensor, eps: float) -> Tensor:  # normalized in fp32
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _torch_fused_add_rmsnorm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    residual = residual + x
    return _torch_rmsnorm(residual, weight, eps), residual


def _torch_silu_and_mul(x: Tensor) -> Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate-half RoPE as in transformers' Llama: x (T, H, D), cos/sin (T, D/2) -> (T, H, D)."""
    x1, x2 = x.chunk(2, dim=-1)  # (T, H, D/2) each
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _torch_rope(cos_sin: Tensor, positions: Tensor, dtype: torch.dtype) -> RopeStep:
    half = cos_sin.shape[1] // 2
    table = cos_sin[positions]  # (T, D)
    cos, sin = table[:, :half].to(dtype), table[:, half:].to(dtype)  # (T, D/2) each, shared by all layers
    return RopeStep(cos_sin, positions, lambda q, k: (apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)))


TORCH_OPS = Ops("torch", _torch_rmsnorm, _torch_fused_add_rmsnorm, _torch_silu_and_mul, _torch_rope)


# --- FlashInfer ------------------------------------------------------------------------------

# Our CUDA norm for decode-size rows (``startup.enable_cuda_norm``): (x, residual or None, weight, eps) →
# (normed, x + residual), or None where it does not take the shape; FlashInfer's kernels otherwise.
_small_norm: Callable[[Tensor, Tensor | None, Tensor, float], tuple[Tensor, Tensor] | None] | None = None


def set_small_norm(fn: Callable[[Tensor, Tensor | None, Tensor, float], tuple[Tensor, Tensor] | None] | None) -> None:
    global _small_norm
    _small_norm = fn


def flashinfer_ops() -> Ops:
    """FlashInfer's fused kernels (CUDA, fp16/bf16). ImportError when FlashInfer is missing. Its norms are its
    precompiled CUDA kernels, not the CuTe-DSL ones: FlashInfer reads ``FLASHINFER_USE_CUDA_NORM`` when it is first
    imported, which in a worker is here (the runner builds its model before anything else imports FlashInfer)."""
    os.environ.setdefault("FLASHINFER_USE_CUDA_NORM", "1")
    import flashinfer.activation
    import flashinfer.norm
    import flashinfer.rope

    def rmsnorm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
        if _small_norm is not None and (done := _small_norm(x, None, weight, eps)) is not None:
            return done[0]
        return flashinfer.norm.rmsnorm(x.contiguous(), weight, eps)

    def fused_add_rmsnorm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
        if _small_norm is not None and (done := _small_norm(x, residual, weight, eps)) is not None:
            return done
        x = x.contiguous()
        flashinfer.norm.fused_add_rmsnorm(x, residual, weight, eps)  # in place: residual += x; x = norm
        return x, residual

    def silu_and_mul(x: Tensor) -> Tensor:
        return flashinfer.activation.silu_and_mul(x.contiguous())

    def rope(cos_sin: Tensor, positions: Tensor, dtype: torch.dtype) -> RopeStep:
        head_dim = cos_sin.shape[1]

        def step(q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:  # in place on (strided) views
            flashinfer.rope.apply_rope_with_cos_sin_cache_inplace(positions, q, k, head_dim, cos_sin, is_neox=True)
            return q, k

        return RopeStep(cos_sin, positions, step)

    return Ops("flashinfer", rmsnorm, fused_add_rmsnorm, silu_and_mul, rope)


# --- selection -------------------------------------------------------------------------------

_current: Ops = TORCH_OPS


def current_ops() -> Ops:
    """The set layers bind when constructed (the reference one outside ``use_ops``)."""
    return _current


@contextmanager
def use_ops(ops: Ops) -> Iterator[None]:
    global _current
    previous, _current = _current, ops
    try:
        yield
    finally:
        _current = previous
