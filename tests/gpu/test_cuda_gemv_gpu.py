"""The CUDA decode-size linear (``kernels/gemv.cu``) on the GPU (skipped without CUDA): every e4m3
code widened exactly, both activation dtypes, bf16/fp16 and e4m3 weights, M 1–8 (more: not taken), N
not a multiple of 16, against float64; the same bits run to run and whatever M; captured in a CUDA graph; launched
overlapping the kernel before it (PDL), still reading that kernel's output.

    python -m pytest -q -m gpu tests/gpu/test_cuda_gemv_gpu.py
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

FP8 = torch.float8_e4m3fn


@pytest.fixture(scope="module")
def gemv():
    from services.worker.kernels import cuda_gemv

    for bf16 in (True, False):  # (nvcc is part of the GPU host)
        assert cuda_gemv.library(bf16) is not None, cuda_gemv.unavailable(bf16)
    return cuda_gemv


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_e4m3_code_at_every_lane_position_comes_out_exact(gemv, dtype) -> None:
    codes = torch.arange(256, dtype=torch.uint8)
    codes[codes & 0x7F == 0x7F] = 0  # (the two NaN codes: weights never hold them)
    k = 64
    for at in range(k):  # each code at each k position of a step: every lane and word of the widening
        w = torch.zeros(256, k, dtype=torch.uint8)
        w[:, at] = codes
        x = torch.zeros(1, k, dtype=dtype)
        x[0, at] = 1.0
        w8 = w.view(FP8).cuda()
        y = gemv.linear(x.cuda(), w8, None, gemv.CONFIGS[0])
        assert torch.equal(y.float().cpu(), w.view(FP8).float()[:, at][None, :]), at


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_products_match_float64_for_every_config_and_shape(gemv, dtype) -> None:
    g = torch.Generator(device="cpu").manual_seed(0)
    for n, k in ((100, 64), (4096, 4096), (48, 14336)):
        w = torch.randn(n, k, generator=g) * 0.05
        s = w.abs().amax(1) / 448
        q = (w / s[:, None]).to(FP8)
        for m in (1, 3, 8):
            x = torch.randn(m, k, generator=g).to(dtype).cuda()
            qc, sc, wc = q.cuda(), s.cuda(), w.to(dtype).cuda()
            want_q = x.double() @ (qc.double() * sc.double()[:, None]).t()
            want_p = x.double() @ wc.double().t()
            for cfg in gemv.CONFIGS:
                got_q = gemv.linear(x, qc, sc, cfg).double()
                got_p = gemv.linear(x, wc, None, cfg).double()
                for got, want in ((got_q, want_q), (got_p, want_p)):
                    tol = 1e-2 * want.abs().max() + 1e-6
                    assert got.shape == (m, n) and (got - want).abs().max() <= tol, (n, k, m, cfg)
    nine = torch.zeros(9, 64, dtype=dtype, device="cuda")
    w = torch.zeros(32, 64, dtype=dtype, device="cuda")
    assert not gemv.supports(nine, w) and gemv.configs_for(w, nine) == ()
    with pytest.raises(ValueError):
        gemv.linear(nine, w, None, gemv.CONFIGS[0])


def test_the_same_bits_every_run_whatever_m_and_inside_a_graph(gemv) -> None:
    g = torch.Generator(device="cpu").manual_seed(1)
    q = (torch.randn(6144, 4096, generator=g) * 100).clamp(-448, 448).to(FP8).cuda()
    s = (torch.rand(6144, generator=g) / 100).cuda()
    x = torch.randn(8, 4096, generator=g).to(torch.bfloat16).cuda()
    for cfg in gemv.CONFIGS:
        full = gemv.linear(x, q, s, cfg)
        assert all(torch.equal(gemv.linear(x, q, s, cfg), full) for _ in range(20)), cfg
        for m in (1, 5, 7):
            assert torch.equal(gemv.linear(x[:m], q, s, cfg), full[:m]), (cfg, m)
    cfg = gemv.CONFIGS[-1]
    out = torch.empty(1, 6144, dtype=torch.bfloat16, device="cuda")
    gemv.linear(x[:1], q, s, cfg)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(gemv.linear(x[:1], q, s, cfg))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, gemv.linear(x[:1], q, s, cfg))


def test_launched_overlapping_the_kernel_before_it_reads_that_kernels_output(gemv) -> None:
    """The PDL configs start before the kernel that writes x ends: what they read is still its result —
    eagerly and replayed from a graph, with x made by a long GEMM right before them."""
    g = torch.Generator(device="cpu").manual_seed(3)
    q = (torch.randn(4096, 4096, generator=g) * 100).clamp(-448, 448).to(FP8).cuda()
    s = (torch.rand(4096, generator=g) / 100).cuda()
    a = torch.randn(4, 65536, generator=g).to(torch.bfloat16).cuda()
    b = torch.randn(65536, 4096, generator=g).to(torch.bfloat16).cuda() / 256

    for cfg in (c for c in gemv.CONFIGS if c.pdl):
        plain = dataclasses.replace(cfg, pdl=False)  # (the same kernel, launched after the GEMM has ended)
        want = gemv.linear(a @ b, q, s, plain)
        for _ in range(5):
            assert torch.equal(gemv.linear(a @ b, q, s, cfg), want), cfg
        out = torch.empty_like(want)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out.copy_(gemv.linear(a @ b, q, s, cfg))
        for _ in range(3):
            out.zero_()
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, want), cfg


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_silu_mul_in_the_kernel_and_before_it(gemv, dtype) -> None:
    """M ≤ 2: silu(gate) · up made inside the kernel (spread over the warp, shuffled to the lanes that
    multiply): the same result as the activation kernel first, for e4m3 and plain weights; M > 2: the
    activation kernel first."""
    import torch.nn.functional as F

    from services.worker.kernels.ops import current_ops

    g = torch.Generator(device="cpu").manual_seed(2)
    for k in (14336, 64, 96):
        q = (torch.randn(256, k, generator=g) * 50).clamp(-448, 448).to(FP8).cuda()
        s = torch.full((256,), 1e-3).cuda()
        wp = (torch.randn(256, k, generator=g) * 0.05).to(dtype).cuda()
        for m in (1, 2, 3):
            h = torch.randn(m, 2 * k, generator=g).to(dtype).cuda()
            act = (F.silu(h[:, :k].float()) * h[:, k:].float()).to(dtype)
            for w, sc in ((q, s), (wp, None)):
                if w.dtype != FP8 and k % 32:
                    continue
                if w.dtype == FP8 and k % 64:
                    continue
                want = act.double() @ (w.double() * (sc.double()[:, None] if sc is not None else 1)).t()
                for cfg in gemv.CONFIGS:
                    got = gemv.linear(h, w, sc, cfg, silu_mul=True)
                    assert got.shape == (m, 256)
                    assert (got.double() - want).abs().max() <= 1e-2 * want.abs().max() + 1e-6, (k, m, w.dtype, cfg)
                    if m > gemv.SILU_MAX_M:  # (the model's activation kernel, then the same kernel: the same bits)
                        assert torch.equal(gemv.linear(current_ops().silu_and_mul(h), w, sc, cfg), got), (k, m, cfg)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_activation_made_as_the_sums_are_stored(gemv, dtype) -> None:
    """``act_out``: w = [gate | up], each block 8 gate rows and their 8 up rows; silu(gate) · up (M, N / 2) within
    a rounding step of the projection then the activation kernel (the same rounding of gate and up first), for
    e4m3 and plain weights, every config, M 1–8; N not a multiple of 16 refused."""
    import torch.nn.functional as F

    from services.worker.kernels.ops import _torch_silu_and_mul

    g = torch.Generator(device="cpu").manual_seed(5)
    for inter, k in ((64, 128), (1024, 4096), (14336 // 4, 4096)):
        w = torch.randn(2 * inter, k, generator=g) / k**0.5
        s = w.abs().amax(1) / 448
        q = (w / s[:, None]).to(FP8)
        for wc, sc in ((q.cuda(), s.cuda()), (w.to(dtype).cuda(), None)):
            deq = wc.double() * (sc.double()[:, None] if sc is not None else 1)
            for m in (1, 3, 8):
                x = torch.randn(m, k, generator=g).to(dtype).cuda()
                full = x.double() @ deq.t()
                want = F.silu(full[:, :inter]) * full[:, inter:]
                for cfg in gemv.CONFIGS:
                    got = gemv.linear(x, wc, sc, cfg, act_out=True)
                    assert got.shape == (m, inter) and got.dtype == dtype
                    assert (got.double() - want).abs().max() <= 2e-2 * want.abs().max() + 1e-6, (inter, m, cfg)
                    apart = _torch_silu_and_mul(gemv.linear(x, wc, sc, cfg)).double()
                    ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -10
                    assert ((got.double() - apart).abs() <= 2 * ulp * apart.abs() + 1e-4).all(), (inter, m, cfg)
    with pytest.raises(ValueError):
        gemv.linear(x, torch.zeros(24, k, dtype=dtype, device="cuda"), None, gemv.CONFIGS[0], act_out=True)
