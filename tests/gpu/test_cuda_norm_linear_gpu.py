"""The add-RMSNorm fused into the CUDA decode linear (``cuda_gemv.norm_linear``, ``gemv.cu``'s pipelined kernel with
the norm) on the GPU (skipped without CUDA): against the PyTorch reference (the norm, then the product in float64)
for bf16/fp16, e4m3 and plain weights, M 1–8, with and without a residual (the new residual exactly); the same
bits run to run and replayed from a CUDA graph; launched overlapping the kernel that writes x (PDL), still reading
its output; in a model layer, ``RMSNorm.then`` taking the fused path only where the linear chose the CUDA kernel;
the start-up timing (``small_m.tune_norm_linear``) deciding per shape.

    python -m pytest -q -m gpu tests/gpu/test_cuda_norm_linear_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from services.worker.models.ops import _torch_fused_add_rmsnorm, _torch_rmsnorm

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

FP8 = torch.float8_e4m3fn


@pytest.fixture(scope="module")
def gemv():
    from services.worker.kernels import cuda_gemv

    for bf16 in (True, False):
        assert cuda_gemv.library(bf16) is not None, cuda_gemv.unavailable(bf16)
    return cuda_gemv


def weights(n: int, k: int, g: torch.Generator, dtype: torch.dtype, fp8: bool):
    w = torch.randn(n, k, generator=g) / k**0.5
    if not fp8:
        w = w.to(dtype)
        return w.cuda(), None, w.double()
    s = w.abs().amax(1) / 448
    q = (w / s[:, None]).to(FP8)
    return q.cuda(), s.cuda(), q.double() * s.double()[:, None]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_matches_the_norm_then_the_product(gemv, dtype) -> None:
    g = torch.Generator(device="cpu").manual_seed(0)
    for n, k in ((100, 64), (6144, 4096), (40, 5120)):
        for fp8 in (True, False):
            w, s, deq = weights(n, k, g, dtype, fp8)
            nw = (1 + torch.randn(k, generator=g) / 4).to(dtype).cuda()
            for m in (1, 3, 8):
                if m * k > gemv.NORM_LINEAR_MAX_VALUES:  # (refused: the normed rows must fit shared memory)
                    x = torch.zeros(m, k, dtype=dtype, device="cuda")
                    assert not gemv.norm_linear_supports(x, nw, w)
                    continue
                x, r = (torch.randn(m, k, generator=g).to(dtype).cuda() for _ in range(2))
                for res in (r, None):
                    if res is not None:
                        h, want_r = _torch_fused_add_rmsnorm(x, res, nw, 1e-5)
                    else:
                        h, want_r = _torch_rmsnorm(x, nw, 1e-5), x
                    want = h.double() @ deq.cuda().t()
                    got, got_r = gemv.norm_linear(x, res, nw, 1e-5, w, s)
                    assert got.shape == (m, n) and got.dtype == dtype
                    assert torch.equal(got_r, want_r), (n, k, fp8, m)
                    if res is None:
                        assert got_r is x
                    tol = 2e-2 * want.abs().max() + 1e-6
                    assert (got.double() - want).abs().max() <= tol, (n, k, fp8, m, res is None)


def test_the_same_bits_every_run_in_a_graph_and_overlapping_the_kernel_before(gemv) -> None:
    g = torch.Generator(device="cpu").manual_seed(1)
    w, s, _ = weights(6144, 4096, g, torch.bfloat16, True)
    nw = (1 + torch.randn(4096, generator=g) / 4).bfloat16().cuda()
    a = torch.randn(1, 65536, generator=g).bfloat16().cuda()
    b = (torch.randn(65536, 4096, generator=g) / 256).bfloat16().cuda()
    r = torch.randn(1, 4096, generator=g).bfloat16().cuda()
    x = a @ b
    want, want_r = gemv.norm_linear(x, r, nw, 1e-5, w, s)
    for _ in range(10):  # (x made by a long GEMM right before: the PDL launch must still read its result)
        got, got_r = gemv.norm_linear(a @ b, r, nw, 1e-5, w, s)
        assert torch.equal(got, want) and torch.equal(got_r, want_r)
    out, out_r = torch.empty_like(want), torch.empty_like(want_r)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y, yr = gemv.norm_linear(a @ b, r, nw, 1e-5, w, s)
        out.copy_(y)
        out_r.copy_(yr)
    for _ in range(3):
        out.zero_()
        out_r.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want) and torch.equal(out_r, want_r)


def test_rmsnorm_then_takes_the_kernel_only_where_the_linear_chose_it(gemv, monkeypatch) -> None:
    from services.worker import kernels
    from services.worker.models.layers import MergedColumnParallelLinear, RMSNorm
    from services.worker.models.ops import TORCH_OPS, use_ops
    from services.worker.tp import TPGroup

    monkeypatch.setattr(kernels, "_norm_linear", kernels._norm_linear)  # (put back after the test)
    monkeypatch.setattr(kernels, "norm_fused", kernels.norm_fused)
    assert kernels.enable_norm_linear(torch.device("cuda")).startswith("on")
    g = torch.Generator(device="cpu").manual_seed(2)
    with use_ops(TORCH_OPS), torch.device("cuda"):
        norm = RMSNorm(512, 1e-6)
        lin = MergedColumnParallelLinear(512, [256, 256], False, TPGroup())
    norm.weight.data.copy_(1 + torch.randn(512, generator=g) / 4)
    lin.weight.data.copy_(torch.randn(512, 512, generator=g) / 512**0.5)
    norm, lin = norm.bfloat16(), lin.bfloat16()
    x, r = (torch.randn(2, 512, generator=g).bfloat16().cuda() for _ in range(2))
    want, want_r = lin(norm(x, r.clone())[0]), x + r
    calls = []
    real = kernels._norm_linear
    monkeypatch.setattr(kernels, "_norm_linear", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(kernels, "choices", {})
    monkeypatch.setattr(kernels, "norm_fused", {(512, 512, torch.bfloat16)})
    got, got_r = norm.then(lin, x, r)  # (no choice for the shape: the norm, then cuBLAS)
    assert not calls and torch.equal(got_r, want_r)
    kernels.choices[(512, 512, torch.bfloat16)] = ((4, gemv.CudaConfig(8, 4, 0, True)),)
    got, got_r = norm.then(lin, x, r)
    assert calls and torch.equal(got_r, want_r)
    assert (got.float() - want.float()).abs().max() <= 2e-2 * want.float().abs().max()


def test_the_start_up_timing_decides_per_shape(gemv, monkeypatch) -> None:
    from services.worker import kernels
    from services.worker.kernels import small_m
    from services.worker.models.layers import QKVParallelLinear, RMSNorm, RowParallelLinear
    from services.worker.models.ops import TORCH_OPS, use_ops
    from services.worker.tp import TPGroup

    monkeypatch.setattr(kernels, "choices", {})
    monkeypatch.setattr(kernels, "norm_fused", set())
    with use_ops(TORCH_OPS), torch.device("cuda"):  # (q/k/v: 16 + 2 × 8 heads of 128 = 4096 rows)
        model = torch.nn.ModuleList([RMSNorm(4096, 1e-6), QKVParallelLinear(4096, 128, 16, 8, False, TPGroup()),
                                     RowParallelLinear(8192, 4096, False, TPGroup())]).bfloat16()
    for p in model.parameters():
        p.data.normal_(0, 0.02)
    cfg = gemv.CudaConfig(8, 4, 0, True)
    kernels.choices[(4096, 4096, torch.bfloat16)] = ((1, cfg),)
    kernels.choices[(4096, 8192, torch.bfloat16)] = ((1, cfg),)  # (its input is no norm's output: not timed)
    report = small_m.tune_norm_linear(model, torch.bfloat16)
    assert list(report) == ["4096x4096 bfloat16"], report
    assert report["4096x4096 bfloat16"].startswith("fused" if kernels.norm_fused else "apart")
    assert kernels.norm_fused <= {(4096, 4096, torch.bfloat16)}
