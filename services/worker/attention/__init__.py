"""Attention backends over one paged KV layout (slot-indexed K/V per layer): ``torch`` (the
reference, any device) and ``flashinfer`` (CUDA), chosen once at start-up."""

from __future__ import annotations

import importlib.util

import torch

from services.worker.attention.base import AttentionBackend
from services.worker.kv_pool import KVPool

BACKENDS = ("auto", "flashinfer", "torch")


def resolve_backend(name: str, device: torch.device) -> str:
    """``auto``: flashinfer on CUDA when it is installed, else torch."""
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; expected one of {', '.join(BACKENDS)}")
    if name == "auto":
        return "flashinfer" if device.type == "cuda" and importlib.util.find_spec("flashinfer") else "torch"
    if name == "flashinfer" and device.type != "cuda":
        raise ValueError("the flashinfer attention backend needs a CUDA device")
    return name


def make_backend(name: str, pool: KVPool, num_q_heads: int, decode: str = "auto") -> AttentionBackend:
    """A resolved backend name (``resolve_backend``) -> the backend over ``pool``; ``decode``: the
    flashinfer backend's decode kernel (auto | flashinfer | triton)."""
    if name == "flashinfer":
        from services.worker.attention.flashinfer_backend import FlashInferAttention

        return FlashInferAttention(pool, num_q_heads, decode_kernel=decode)
    from services.worker.attention.torch_backend import TorchAttention

    return TorchAttention(pool)
