"""Our own CUDA kernels (Triton), each used only where a start-up check on the device found it
correct and faster than the library path it would replace.

- ``small_m.py``: linear layers at decode batch sizes (weight-streaming, bf16 or weight-only FP8).
- ``gemm.py``: GEMMs above them (decode batches, mixed steps): FP8 on quantized activations, and bf16/fp16.
- ``rope_store.py``: the rotary embedding and the K/V write in one launch.

This module is the light part the layers call on every step (no Triton import: CPU installs may
lack it): which weight shapes use a kernel, as ``small_m.tune`` measured them. It imports nothing of
``quant`` or ``models`` (they import it); the start-up checks and tunings that fill it are in
``services/worker/startup.py``.
"""

from __future__ import annotations

import torch

from services.worker.numerics import cdiv, pow2_at_least  # noqa: F401 (the kernels' helpers, re-exported)

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


def reset() -> None:
    """Forget every decision (benchmarks and tests that tune again)."""
    choices.clear()
    tuned.clear()
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
