"""Our FP8 GEMM (``kernels/fp8_gemm.py``) in Triton's interpreter on the CPU, against float32 on the dequantized
operands: tiles that do not divide M, N or K, several row tiles in a group and groups cut short (the program →
tile mapping covers every tile once), per-token and per-channel scales; and ``kernels.try_fp8_gemm``'s choice by
range of M. Its compilation for sm_90 (FP8 ``wgmma``, no spills) is in test_triton_compile_sm90.py; its speed is
chosen on the GPU at start-up. Skipped visibly where Triton is not installed."""

from __future__ import annotations

import pytest

from tests.support import run_in_triton_interpreter

SCRIPT = r"""
import torch
from services.worker import kernels
from services.worker.kernels import fp8_gemm as fg
from services.worker.quant.fp8 import quantize_per_token, quantize_rows

g = torch.Generator().manual_seed(0)
for m, n, k, cfg in ((5, 40, 96, fg.GemmConfig(16, 16, 32, group_m=2)),     # K not a multiple of the tile
                     (37, 72, 64, fg.GemmConfig(16, 32, 32, group_m=2)),    # 3 row tiles: a group cut short
                     (70, 48, 128, fg.GemmConfig(32, 16, 64, group_m=8))):  # M and N not multiples of the tile
    x = torch.randn(m, k, generator=g) * torch.logspace(-1, 1, m)[:, None]
    w = torch.randn(n, k, generator=g) * torch.logspace(-1, 1, n)[:, None]
    xq, xs = quantize_per_token(x)
    wq, ws = quantize_rows(w)
    want = (xq.float() * xs) @ (wq.float() * ws[:, None]).t()
    got = fg.matmul(xq, xs, wq, ws, torch.float32, cfg)
    assert got.shape == (m, n)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4 * want.abs().max()), (m, n, k, (got - want).abs().max())

kernels.fp8_gemm_choices[(n, k)] = ((32, None), (64, cfg))  # (M ≤ 32: the library; 33-64: ours; above: the library)
assert kernels.try_fp8_gemm(xq[:20], xs[:20], wq, ws, torch.float32) is None
got = kernels.try_fp8_gemm(xq[:50], xs[:50], wq, ws, torch.float32)
assert got is not None and torch.allclose(got, want[:50], rtol=1e-4, atol=1e-4 * want.abs().max())
assert kernels.try_fp8_gemm(xq, xs, wq, ws, torch.float32) is None  # (70 rows: above the last range)
assert kernels.try_fp8_gemm(xq[:50], xs[:50], wq[:, :64], ws, torch.float32) is None  # (another shape)
kernels.reset()
assert kernels.try_fp8_gemm(xq[:50], xs[:50], wq, ws, torch.float32) is None
print("fp8 gemm ok")
"""


@pytest.mark.timeout(300)
def test_fp8_gemm_in_the_interpreter() -> None:
    pytest.importorskip("triton", reason="Triton is not installed")
    run_in_triton_interpreter(SCRIPT, "fp8 gemm ok", timeout=280)
