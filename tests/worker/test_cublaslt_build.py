"""cuBLASLt's other algorithms (``kernels/cublaslt.py``, ``lt.cu``), the CPU-checkable parts: the source compiles
with nvcc against cuBLASLt's header into a library exporting the three calls (and is then found in the cache);
without CUDA no candidates are offered and ``gemm.matmul`` given such a config runs the library's product; a config
survives the tuning cache's encoding. The algorithms themselves run in ``tests/gpu/test_cublaslt_gpu.py``."""

from __future__ import annotations

import ctypes

import pytest
import torch
import torch.nn.functional as F

from services.worker.kernels import cublaslt, gemm, nvcc, tuning_cache


def test_the_source_compiles_against_the_header_and_is_cached(tmp_path) -> None:
    compiler, include = nvcc.find_nvcc(), next(iter(cublaslt.include_dirs()), None)
    if compiler is None or include is None:
        pytest.skip("nvcc or cublasLt.h not here (the GPU host has both: torch's nvidia wheels carry the header)")
    lib = cublaslt.build("sm_90a", compiler, tmp_path, include)
    assert lib.is_file() and lib.name.startswith("lt_sm_90a_")
    loaded = ctypes.CDLL(str(lib))
    assert all(hasattr(loaded, f"banyan_lt_{name}") for name in ("algos", "check", "matmul"))
    assert cublaslt.build("sm_90a", compiler, tmp_path, include) == lib  # (cached: same source, header, nvcc)
    assert [p.name for p in tmp_path.iterdir()] == [lib.name]


def test_no_candidates_without_cuda_and_the_library_runs_instead(monkeypatch) -> None:
    monkeypatch.setattr(cublaslt, "_state", {})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("BANYAN_GEMM_LT", "1")
    assert cublaslt.candidates(64, 4096, 4096, torch.bfloat16) == []
    assert "no CUDA" in (cublaslt.unavailable() or "")
    cfg = cublaslt.LtConfig(3, "00" * 64, 0)
    x, w = torch.randn(5, 64, dtype=torch.bfloat16), torch.randn(32, 64, dtype=torch.bfloat16)
    assert cublaslt.matmul(x, w, cfg) is None
    assert torch.equal(gemm.matmul(x, w, torch.bfloat16, cfg), F.linear(x, w))  # (refused: the library's)
    assert cublaslt.candidates(64, 4096, 4096, torch.float32) == []  # (bf16 / fp16 only)
    monkeypatch.setattr(cublaslt, "library", lambda: pytest.fail("asked for the library while off"))
    monkeypatch.delenv("BANYAN_GEMM_LT")  # (opt-in until measured on the GPU)
    assert cublaslt.candidates(64, 4096, 4096, torch.bfloat16) == []


def test_a_config_survives_the_tuning_cache_and_names_itself() -> None:
    cfg = cublaslt.LtConfig(2, "ab" * 64, 1 << 20)
    assert str(cfg) == "lt2"
    assert tuning_cache.decode(tuning_cache.encode(cfg), (gemm.GemmConfig, cublaslt.LtConfig)) == cfg
    assert tuning_cache.decode(tuning_cache.encode(cfg), (gemm.GemmConfig,)) is None  # (a type not offered)
    assert "BANYAN_GEMM_LT" in tuning_cache.KNOBS
