"""The add-RMSNorm after a CUDA decode linear, done by the linear's last block (``cuda_gemv.linear_then_norm``,
``gemv.cu``'s ``norm_after``) on the GPU (skipped without CUDA): against the linear's own output then the PyTorch
reference norm, for bf16/fp16, e4m3 and plain weights, 4/8/16 warps, M 1–8, with and without a residual (the new
residual exactly); its counts left zero; the same bits replayed from a CUDA graph; the start-up check turning it on
(``BANYAN_LINEAR_NORM=1``) and a layer's ``RMSNorm.after`` taking it.

    python -m pytest -q -m gpu tests/gpu/test_cuda_linear_norm_gpu.py
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
    cuda_gemv.init_counts(torch.device("cuda"))
    return cuda_gemv


def weights(n: int, k: int, g: torch.Generator, dtype: torch.dtype, fp8: bool):
    w = torch.randn(n, k, generator=g) / k**0.5
    if not fp8:
        return w.to(dtype).cuda(), None
    s = w.abs().amax(1) / 448
    return (w / s[:, None]).to(FP8).cuda(), s.cuda()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_matches_the_linear_then_the_norm(gemv, dtype) -> None:
    g = torch.Generator(device="cpu").manual_seed(0)
    for n, k in ((4096, 4096), (4096, 14336), (136, 512)):
        for fp8 in (True, False):
            w, s = weights(n, k, g, dtype, fp8)
            nw = (1 + torch.randn(n, generator=g) / 4).to(dtype).cuda()
            for warps in (4, 8, 16):
                cfg = gemv.CudaConfig(warps, 2, 0, True, True)
                for m in (1, 3, 8):
                    x = torch.randn(m, k, generator=g).to(dtype).cuda()
                    r = torch.randn(m, n, generator=g).to(dtype).cuda()
                    y = gemv.linear(x, w, s, cfg)
                    for res in (r, None):
                        want, want_r = _torch_fused_add_rmsnorm(y, res, nw, 1e-5) if res is not None else (
                            _torch_rmsnorm(y, nw, 1e-5), y)
                        got, got_r = gemv.linear_then_norm(x, w, s, cfg, res, nw, 1e-5)
                        assert torch.equal(got_r, want_r), (n, k, fp8, warps, m)
                        err = (got.float() - want.float()).abs().max().item()
                        assert err <= 2e-2 * want.float().abs().max().item(), (n, k, fp8, warps, m, err)
    assert int(gemv._counts[torch.device("cuda")].abs().sum()) == 0  # (each launch's last block reset its count)


def test_replays_from_a_graph(gemv) -> None:
    g = torch.Generator(device="cpu").manual_seed(1)
    w, s = weights(4096, 4096, g, torch.bfloat16, True)
    nw = (1 + torch.randn(4096, generator=g) / 4).bfloat16().cuda()
    x, r = torch.randn(1, 4096, generator=g).bfloat16().cuda(), torch.randn(1, 4096, generator=g).bfloat16().cuda()
    cfg = gemv.CudaConfig(16, 2, 0, True, True)
    want = gemv.linear_then_norm(x, w, s, cfg, r, nw, 1e-5)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        gemv.linear_then_norm(x, w, s, cfg, r, nw, 1e-5)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        got = gemv.linear_then_norm(x, w, s, cfg, r, nw, 1e-5)
    for _ in range(3):
        x.copy_(torch.randn(1, 4096, generator=g).bfloat16())
        graph.replay()
        torch.cuda.synchronize()
        want = gemv.linear_then_norm(x, w, s, cfg, r, nw, 1e-5)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_turned_on_at_start_up_and_taken_by_a_layer(gemv, monkeypatch) -> None:
    from services.worker import kernels
    from services.worker.models.layers import RMSNorm, RowParallelLinear
    from services.worker.models.ops import TORCH_OPS, use_ops
    from services.worker.tp import TPGroup

    monkeypatch.setattr(kernels, "_linear_norm", kernels._linear_norm)  # (put back after the test)
    monkeypatch.setattr(kernels, "choices", {})
    monkeypatch.setenv("BANYAN_LINEAR_NORM", "1")
    assert kernels.enable_linear_norm(torch.device("cuda")).startswith("on")
    g = torch.Generator(device="cpu").manual_seed(2)
    with use_ops(TORCH_OPS), torch.device("cuda"):
        norm = RMSNorm(4096, 1e-5)
        lin = RowParallelLinear(4096, 4096, False, TPGroup())
    norm.weight.data.copy_(1 + torch.randn(4096, generator=g) / 4)
    lin.weight.data.copy_(torch.randn(4096, 4096, generator=g) / 64)
    norm, lin = norm.bfloat16(), lin.bfloat16()
    x, r = (torch.randn(1, 4096, generator=g).bfloat16().cuda() for _ in range(2))
    calls = []
    real = kernels._linear_norm
    monkeypatch.setattr(kernels, "_linear_norm", lambda *a: calls.append(1) or real(*a))
    got, got_r = norm.after(lin, x, r)  # (no choice for the shape: cuBLAS, then the norm)
    want, want_r = norm(lin(x), r.clone())
    assert not calls and torch.equal(got_r, want_r)
    kernels.choices[(4096, 4096, torch.bfloat16)] = ((16, gemv.CudaConfig(16, 2, 0, True, True)),)
    want, want_r = norm(lin(x), r.clone())  # (the CUDA kernel's product)
    got, got_r = norm.after(lin, x, r)
    assert calls == [1] and torch.equal(got_r, want_r)
    assert (got.float() - want.float()).abs().max() <= 2e-2 * want.float().abs().max()
