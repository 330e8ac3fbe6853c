"""Our GEMM (``kernels/gemm.py``) in Triton's interpreter on the CPU, against float32 on the (dequantized)
operands: FP8 with per-token and per-channel scales, and plain (float32 here, standing for bf16/fp16); tiles that
do not divide M, N or K, several row tiles in a group and groups cut short (the program → tile mapping covers every
tile once); K in parts added by a second kernel (a part ending inside a tile; fewer parts than asked); and
``kernels.try_gemm``'s choice by weight shape, dtype and range of M. Its compilation for sm_90 (FP8
and bf16 ``wgmma``, no spills) is in test_triton_compile_sm90.py; its speed is chosen on the GPU at start-up.
Skipped visibly where Triton is not installed."""

from __future__ import annotations

import pytest

from tests.support import run_in_triton_interpreter

SCRIPT = r"""
import torch
from services.worker import kernels
from services.worker.kernels import gemm
from services.worker.quant.fp8 import quantize_per_token, quantize_rows

g = torch.Generator().manual_seed(0)
for m, n, k, cfg in ((5, 40, 96, gemm.GemmConfig(16, 16, 32, group_m=2)),     # K not a multiple of the tile
                     (37, 72, 64, gemm.GemmConfig(16, 32, 32, group_m=2)),    # 3 row tiles: a group cut short
                     (5, 40, 100, gemm.GemmConfig(16, 16, 32)),               # K not a multiple: a masked last tile
                     (70, 48, 128, gemm.GemmConfig(32, 16, 64, group_m=8))):  # M and N not multiples of the tile
    x = torch.randn(m, k, generator=g) * torch.logspace(-1, 1, m)[:, None]
    w = torch.randn(n, k, generator=g) * torch.logspace(-1, 1, n)[:, None]
    xq, xs = quantize_per_token(x)
    wq, ws = quantize_rows(w)
    want = (xq.float() * xs) @ (wq.float() * ws[:, None]).t()
    got = gemm.matmul(xq, wq, torch.float32, cfg, xs, ws)
    assert got.shape == (m, n)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4 * want.abs().max()), (m, n, k, (got - want).abs().max())
    plain = gemm.matmul(x[:, :k], w, torch.float32, cfg)  # (no scales: x w^T)
    assert torch.allclose(plain, x @ w.t(), rtol=1e-3, atol=1e-3 * (x @ w.t()).abs().max()), (m, n, k)

kernels.gemm_choices[(n, k, wq.dtype)] = ((32, None), (64, cfg))  # (M ≤ 32: the library; 33-64: ours; above: it)
assert kernels.try_gemm(xq[:20], wq, torch.float32, xs[:20], ws) is None
got = kernels.try_gemm(xq[:50], wq, torch.float32, xs[:50], ws)
assert got is not None and torch.allclose(got, want[:50], rtol=1e-4, atol=1e-4 * want.abs().max())
assert kernels.try_gemm(xq, wq, torch.float32, xs, ws) is None  # (70 rows: above the last range)
assert kernels.try_gemm(xq[:50], wq[:, :64], torch.float32, xs[:50], ws) is None  # (another shape)
assert kernels.try_gemm(x[:50], w, torch.float32) is None  # (the same shape in another dtype: not chosen)
kernels.gemm_choices[(n, k, w.dtype)] = ((64, cfg),)
assert torch.allclose(kernels.try_gemm(x[:50], w, torch.float32), x[:50] @ w.t(), rtol=1e-3, atol=1e-2)
kernels.reset()
assert kernels.try_gemm(xq[:50], wq, torch.float32, xs[:50], ws) is None
print("gemm ok")
"""


@pytest.mark.timeout(300)
def test_gemm_in_the_interpreter() -> None:
    pytest.importorskip("triton", reason="Triton is not installed")
    run_in_triton_interpreter(SCRIPT, "gemm ok", timeout=280)


def test_the_tuning_checks_a_large_range_at_its_first_and_last_rows() -> None:
    """Above 2 × ``EDGE_ROWS`` rows the start-up check compares the first and the last ``EDGE_ROWS`` rows (where a
    tile's masks or the grouping of row tiles would go wrong) with float32; up to it, every row."""
    pytest.importorskip("triton", reason="Triton is not installed")
    import torch

    from services.worker.kernels import gemm

    assert gemm._edges(64) == slice(None) and gemm._edges(2 * gemm.EDGE_ROWS) == slice(None)
    rows = gemm._edges(16384)
    assert rows.tolist() == list(range(gemm.EDGE_ROWS)) + list(range(16384 - gemm.EDGE_ROWS, 16384))
    x = torch.arange(2048.0)[:, None]
    assert x[gemm._edges(2048)].shape == (2 * gemm.EDGE_ROWS, 1) and x[gemm._edges(2048)][-1, 0] == 2047


def test_the_launch_arithmetic_matches_tritons() -> None:
    """``kernels.cdiv`` / ``pow2_at_least`` (the launches' grid and block sizes without Triton's ~2-µs constexpr
    wrappers) give Triton's values."""
    triton = pytest.importorskip("triton")
    from services.worker.kernels import cdiv, pow2_at_least

    assert [pow2_at_least(n) for n in range(1, 4100)] == [triton.next_power_of_2(n) for n in range(1, 4100)]
    assert pow2_at_least(0) == 1
    assert all(cdiv(a, b) == triton.cdiv(a, b) for a in range(0, 600) for b in range(1, 70))
