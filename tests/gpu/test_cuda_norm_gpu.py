"""The decode-size add-RMSNorm (``kernels/norm.cu``) on the GPU (skipped without CUDA): against the PyTorch
reference for M 1–8, widths 8 to 32,768, bf16 and fp16, with and without a residual (the new residual
exactly; the normed rows within rounding); the same bits run to run and in a CUDA graph; launched to
overlap the kernel before it (PDL), still reading that kernel's output; shapes it does not take refused.

    python -m pytest -q -m gpu tests/gpu/test_cuda_norm_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from services.worker.kernels.ops import _torch_fused_add_rmsnorm, _torch_rmsnorm

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def lib():
    from services.worker.kernels import cuda_gemv

    for bf16 in (True, False):
        assert cuda_gemv.library(bf16) is not None, cuda_gemv.unavailable(bf16)
    return cuda_gemv


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    # one rounding step of the 16-bit type apart at most (the reference sums in another order; its rsqrt differs)
    ulp = 2.0 ** -7 if got.dtype == torch.bfloat16 else 2.0 ** -10
    return bool(((got.float() - want.float()).abs() <= 2 * ulp * want.float().abs() + 1e-3).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_matches_the_reference(lib, dtype) -> None:
    g = torch.Generator(device="cpu").manual_seed(0)
    for k in (8, 128, 4096, 5120, 8200, 14336, 32768):
        for m in (1, 2, 5, 8):
            x, r = (torch.randn(m, k, generator=g).to(dtype).cuda() for _ in range(2))
            w = (1 + torch.randn(k, generator=g) / 4).to(dtype).cuda()
            want, want_r = _torch_fused_add_rmsnorm(x, r, w, 1e-5)
            got, got_r = lib.add_rmsnorm(x, r, w, 1e-5)
            assert torch.equal(got_r, want_r), (k, m)
            assert close(got, want), (k, m, (got.float() - want.float()).abs().max())
            plain, same = lib.add_rmsnorm(x, None, w, 1e-5)
            assert same is x and close(plain, _torch_rmsnorm(x, w, 1e-5)), (k, m)
    for bad in (torch.zeros(9, 64, dtype=dtype), torch.zeros(1, 68, dtype=dtype), torch.zeros(2, 40000, dtype=dtype)):
        assert not lib.norm_supports(bad.cuda(), torch.ones(bad.shape[1], dtype=dtype).cuda())
        with pytest.raises(ValueError):
            lib.add_rmsnorm(bad.cuda(), None, torch.ones(bad.shape[1], dtype=dtype).cuda(), 1e-5)


def test_strided_rows_and_the_same_bits_every_run_and_in_a_graph(lib) -> None:
    g = torch.Generator(device="cpu").manual_seed(1)
    wide = torch.randn(4, 6144, generator=g).bfloat16().cuda()
    x = wide[:, :4096]  # (rows 6144 apart: a slice of a fused projection's output)
    r = torch.randn(4, 4096, generator=g).bfloat16().cuda()
    w = (1 + torch.randn(4096, generator=g) / 4).bfloat16().cuda()
    want = lib.add_rmsnorm(x.contiguous(), r, w, 1e-6)
    for _ in range(10):
        got = lib.add_rmsnorm(x, r, w, 1e-6)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    out = torch.empty_like(want[0])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(lib.add_rmsnorm(x, r, w, 1e-6)[0])
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want[0])


def test_launched_overlapping_the_kernel_before_it_reads_that_kernels_output(lib) -> None:
    g = torch.Generator(device="cpu").manual_seed(2)
    a = torch.randn(2, 65536, generator=g).bfloat16().cuda()
    b = torch.randn(65536, 4096, generator=g).bfloat16().cuda() / 256
    r = torch.randn(2, 4096, generator=g).bfloat16().cuda()
    w = (1 + torch.randn(4096, generator=g) / 4).bfloat16().cuda()
    want = lib.add_rmsnorm(a @ b, r, w, 1e-6, pdl=False)
    for _ in range(5):
        got = lib.add_rmsnorm(a @ b, r, w, 1e-6, pdl=True)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    out = torch.empty_like(want[0])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(lib.add_rmsnorm(a @ b, r, w, 1e-6)[0])
    for _ in range(3):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want[0])


def test_the_flashinfer_ops_take_it_for_decode_rows_only(lib, monkeypatch) -> None:
    from services.worker.startup import enable_cuda_norm
    from services.worker.kernels import ops

    assert enable_cuda_norm(torch.device("cuda")).startswith("ours")
    calls = []
    real = lib.launch_add_rmsnorm  # (what the ops' hook launches: ``norm_supports`` already checked)
    monkeypatch.setattr(lib, "launch_add_rmsnorm", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    try:
        fi = ops.flashinfer_ops()
        g = torch.Generator(device="cpu").manual_seed(3)
        w = (1 + torch.randn(4096, generator=g) / 4).bfloat16().cuda()
        for m in (1, 8, 9, 64):
            x, r = (torch.randn(m, 4096, generator=g).bfloat16().cuda() for _ in range(2))
            want, want_r = _torch_fused_add_rmsnorm(x, r, w, 1e-6)
            got, got_r = fi.fused_add_rmsnorm(x.clone(), r.clone(), w, 1e-6)
            assert close(got, want) and close(got_r, want_r), m
        assert calls == [1, 8]  # (9 and 64 rows: FlashInfer's)
    finally:
        ops.set_small_norm(None)
