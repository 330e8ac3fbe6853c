"""The start-up tunings with their decisions on disk (``kernels/tuning_cache.py``; skipped without CUDA): a second
tuning of the same shapes (a restarted server) reuses every decision, chooses the same kernels and says so; a
cached config that fails its check again is timed again; a changed knob is a different fingerprint."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from services.worker import kernels
from services.worker.quant import fp8

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton"),
]


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("BANYAN_TUNING_CACHE", str(tmp_path))
    kernels.reset()
    yield tmp_path
    kernels.reset()


def weights():
    g = torch.Generator(device="cpu").manual_seed(3)
    wq, ws = (t.cuda() for t in fp8.quantize_rows(torch.randn(4096, 4096, generator=g) * 0.02))
    return [(wq, ws), ((torch.randn(6144, 4096, generator=g) * 0.02).bfloat16().cuda(), None)]


def test_a_second_tuning_reuses_every_decision(cache) -> None:
    from services.worker.kernels import gemm, small_m

    w = weights()
    first = gemm.tune(w, torch.bfloat16, fp8.quantize_activation, fp8.library_gemm)
    sm_first = small_m.tune([w[1]], lambda x, w, s: F.linear(x, w), torch.bfloat16)
    chosen, sm_chosen = dict(kernels.gemm_choices), dict(kernels.choices)
    assert len(list(cache.glob("*.json"))) == 1  # (one fingerprint; its lock file beside it)
    assert not any("(cached)" in v for v in [*first.values(), *sm_first.values()])
    kernels.reset()
    again = gemm.tune(w, torch.bfloat16, fp8.quantize_activation, fp8.library_gemm)
    sm_again = small_m.tune([w[1]], lambda x, w, s: F.linear(x, w), torch.bfloat16)
    assert again == {k: v + " (cached)" for k, v in first.items()}
    assert sm_again == {k: v + " (cached)" for k, v in sm_first.items()}
    assert kernels.gemm_choices == chosen and kernels.choices == sm_chosen


def test_a_cached_config_that_fails_its_check_is_timed_again(cache, monkeypatch) -> None:
    from services.worker.kernels import gemm, small_m

    w = weights()[:1]
    first = gemm.tune(w, torch.bfloat16, fp8.quantize_activation, fp8.library_gemm)
    if not kernels.gemm_choices:
        pytest.skip("the library won every range of this shape here: no config to check again")
    kernels.reset()
    monkeypatch.setattr(small_m, "_close", lambda got, want: False)  # (every check fails: configs are wrong now)
    again = gemm.tune(w, torch.bfloat16, fp8.quantize_activation, fp8.library_gemm)
    assert not kernels.gemm_choices and all("(cached)" not in v for v in again.values())
    assert again.keys() == first.keys()


def test_another_knob_is_another_fingerprint(cache, monkeypatch) -> None:
    from services.worker.kernels import tuning_cache

    dev = torch.device("cuda")
    before = tuning_cache.fingerprint(dev)
    monkeypatch.setenv("BANYAN_GEMM", "fp8")
    assert tuning_cache.fingerprint(dev) != before
    monkeypatch.delenv("BANYAN_GEMM")
    saved = fp8.set_fast_accum(not fp8.fast_accum())
    try:
        assert tuning_cache.fingerprint(dev) != before
    finally:
        fp8.set_fast_accum(saved)
    assert tuning_cache.fingerprint(dev) == before
