"""cuBLASLt's other algorithms (``kernels/cublaslt.py``) on the GPU (skipped without CUDA): the heuristic offers
some for the 8B shapes at decode rows, each computes what cuBLAS's F.linear does at a range's both ends and between
(and on rows of a wider tensor), inside a CUDA graph as eagerly, and ``gemm.matmul`` runs them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.worker.kernels import cublaslt
from services.worker.kernels import gemm as fg
from tests.gpu.test_gpu_parity import rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(autouse=True)
def library(monkeypatch):
    monkeypatch.setenv("BANYAN_GEMM_LT", "1")  # (opt-in)
    if cublaslt.library() is None:
        pytest.fail(f"cuBLASLt's calls did not load: {cublaslt.unavailable()}")  # (on a GPU host they must)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_candidate_matches_cublas_across_its_range(dtype) -> None:
    g = torch.Generator(device="cpu").manual_seed(3)
    shapes = ((4096, 4096), (6144, 4096), (4096, 14336), (1000, 520)) if dtype == torch.bfloat16 else ((4096, 4096),)
    for n, k in shapes:
        w = (torch.randn(n, k, generator=g) * 0.02).to(dtype).cuda()
        x = torch.randn(128, k + 8, generator=g).to(dtype).cuda()
        for low, top in ((17, 32), (33, 64), (65, 128)):
            cands = cublaslt.candidates(top, n, k, dtype, lowest_m=low)
            assert cands and all(c.rank < cublaslt.MAX_ALGOS for c in cands), (n, k, top)
            for cfg in cands:
                for m in (low, (low + top) // 2, top):
                    for rows in (x[:m, :k].contiguous(), x[:m, :k]):  # (and rows k + 8 apart)
                        want = F.linear(rows, w).float()
                        got = fg.matmul(rows, w, dtype, cfg)
                        assert rel_err(got, want) < 1e-2, (n, k, m, cfg, rows.stride())


def test_a_candidate_replays_from_a_cuda_graph_as_it_runs_eagerly() -> None:
    g = torch.Generator(device="cpu").manual_seed(4)
    w = (torch.randn(14336, 4096, generator=g) * 0.02).bfloat16().cuda()
    x = torch.randn(64, 4096, generator=g).bfloat16().cuda()
    cands = cublaslt.candidates(64, 14336, 4096, torch.bfloat16)
    assert cands
    for cfg in cands:
        eager = cublaslt.matmul(x, w, cfg)
        assert eager is not None, cfg
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            cublaslt.matmul(x, w, cfg)  # (warm: descriptors made outside the capture)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = cublaslt.matmul(x, w, cfg)
        x.copy_(torch.randn(64, 4096, generator=g).bfloat16())
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, cublaslt.matmul(x, w, cfg)), cfg  # (the same algorithm: the same bits)


def test_prompt_sized_ranges_and_calls_past_the_plan_cache() -> None:
    """A prompt-sized range's candidates (``gemm.LT_MAX_M``) compute what F.linear does at its both ends; calls at
    more distinct M than ``lt.cu`` caches plans for (4,096) still do (their descriptors made and released per call)."""
    g = torch.Generator(device="cpu").manual_seed(5)
    w = (torch.randn(1024, 512, generator=g) * 0.02).bfloat16().cuda()
    x = torch.randn(4200 + 4, 512, generator=g).bfloat16().cuda()
    cands = cublaslt.candidates(4096, 1024, 512, torch.bfloat16, lowest_m=2049)
    assert cands
    for cfg in cands:
        for m in (2049, 4096):
            assert rel_err(fg.matmul(x[:m], w, torch.bfloat16, cfg), F.linear(x[:m], w).float()) < 1e-2, (cfg, m)
    cfg = min(cands, key=lambda c: c.workspace)  # (one that needs no split-K workspace runs at any M)
    for m in range(1, 4200):  # (past the bound whatever ran before)
        y = cublaslt.matmul(x[:m], w, cfg)
        assert y is not None, m
    assert rel_err(y, F.linear(x[:4199], w).float()) < 1e-2
    assert rel_err(cublaslt.matmul(x[:4204], w, cfg), F.linear(x[:4204], w).float()) < 1e-2
