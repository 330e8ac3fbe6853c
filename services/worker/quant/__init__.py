"""Quantization: FP8 (e4m3) weights and KV cache.

- ``config.py``   which quantization a model is served with (flag + checkpoint), unsupported ones refused
- ``checkpoint.py`` reading FP8 checkpoints: weights paired with their scales, block-wise scales
  dequantized, KV-cache scales collected, activation scales dropped
- ``fp8.py``      the numerics (quantize, per-token activations, the FP8 linear) in PyTorch
- ``kv.py``       the KV cache's FP8 storage and scales
- ``triton_kernels.py`` fused CUDA kernels (per-token activation quantization, the norm and the activation
  quantizing as they write, quantized KV write),
  used once checked against the PyTorch reference at start-up

Layers built inside ``fp8_linears(True)`` (the loader does it) store FP8 weights; nothing
dispatches per call.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from shared.logging import get_logger

log = get_logger("worker")
_fp8_linears = False
_fp8_vocab = False


def fp8_linears_enabled() -> bool:
    """Whether linear layers built now store FP8 weights (``fp8_linears``)."""
    return _fp8_linears


def fp8_vocab_enabled() -> bool:
    """Whether the embeddings and lm_head built now store FP8 weights (``fp8_linears(vocab=True)``)."""
    return _fp8_vocab


@contextmanager
def fp8_linears(enabled: bool, vocab: bool = False) -> Iterator[None]:
    global _fp8_linears, _fp8_vocab
    previous, _fp8_linears, _fp8_vocab = (_fp8_linears, _fp8_vocab), enabled, enabled and vocab
    try:
        yield
    finally:
        _fp8_linears, _fp8_vocab = previous


def enable_plain_kv_store(device: torch.device) -> str:
    """One Triton launch for a bf16/fp16 pool's K and V write, where it writes exactly what
    ``index_copy_`` does on ``device`` → what the pool uses (logged)."""
    from services.worker.quant import kv

    try:
        from services.worker.quant import triton_kernels as tk

        if tk.check_store_kv_plain(device):
            kv.set_plain_store_kernel(tk.store_kv)
            return "triton"
    except Exception as e:  # no Triton, a compiler problem: index_copy_ is correct, only one launch slower
        log.warning("kv_store_kernel_unavailable", reason=f"{type(e).__name__}: {e}"[:300])
    kv.set_plain_store_kernel(None)
    return "index_copy"


def enable_cuda_kernels(device: torch.device) -> dict[str, str]:
    """Use the Triton kernels on ``device`` where they agree with the PyTorch reference there;
    → which implementation each operation got (logged). Any failure keeps the PyTorch one."""
    from services.worker.quant import fp8, kv

    asked = fp8.fast_accum()
    chosen = {"gemm": "scaled_mm" if fp8.check_scaled_mm(device) else "dequantize", "activation_quant": "torch",
              "kv_store": "torch", "fused_quant": "off" if fp8.fused_quant() is None else "op, then the quantization",
              "fast_accum": "on" if fp8.fast_accum() else "off (failed its check)" if asked else "off"}
    if chosen["gemm"] != "scaled_mm":
        log.warning("fp8_scaled_mm_unavailable", device=str(device))
    try:
        from services.worker.quant import triton_kernels as tk

        if tk.check_per_token_quant(device):
            fp8.set_activation_quant(tk.per_token_quant)
            chosen["activation_quant"] = "triton"
        if tk.check_store_kv(device):
            kv.set_store_kernel(tk.store_kv)
            chosen["kv_store"] = "triton"
        if fp8.fused_quant() is not None:  # (BANYAN_FP8_FUSED_QUANT=0: None, the linears quantize their input)
            fused = tk.check_fused_quant(device)
            fp8.set_fused_quant(fused or fp8.FusedQuant(None, None))
            chosen["fused_quant"] = "triton" if fused is not None else "op, then the quantization (kernels disagreed)"
    except Exception as e:  # no Triton, a compiler problem: the reference ops are correct, only slower
        log.warning("fp8_kernels_unavailable", reason=f"{type(e).__name__}: {e}"[:300])
    return chosen
