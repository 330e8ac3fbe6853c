"""Our FP8 GEMM (``kernels/fp8_gemm.py``) on the GPU (skipped without CUDA + FlashInfer): every config against the
library GEMM on the same quantized operands at decode-batch and mixed-step sizes (precise and fast accumulation),
what ``tune`` picks, and a worker whose FP8 linears all take it (eager steps) against the same worker on the
library's GEMM."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from benchmarks.driver import Driver
from tests.gpu.test_gpu_parity import REPORT, _schedule, models, rel_err, runner  # noqa: F401 (fixtures)
from services.worker import kernels
from services.worker.kernels import fp8_gemm as fg
from services.worker.quant import fp8

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None, reason="needs FlashInfer"),
]


@pytest.mark.parametrize("fast", [False, True])
def test_every_config_matches_the_library_gemm(fast) -> None:
    g = torch.Generator(device="cpu").manual_seed(0)
    saved = fp8.set_fast_accum(fast)
    try:
        for n, k in ((6144, 4096), (4096, 14336), (1000, 520)):  # (the last: N and K not multiples of the tiles)
            wq, ws = (t.cuda() for t in fp8.quantize_rows(torch.randn(n, k, generator=g) * 0.02))
            for m in (17, 90, 600, 3000):
                xa = fp8.quantize_activation(torch.randn(m, k, generator=g).bfloat16().cuda())
                want = fp8.library_gemm(xa, wq, ws).float()
                for cfg in fg.CONFIGS:
                    err = rel_err(fg.matmul(xa.q, xa.scale, wq, ws, torch.bfloat16, cfg), want)
                    assert err < 1e-2, (n, k, m, cfg, fast, err)
    finally:
        fp8.set_fast_accum(saved)


def test_tune_picks_only_correct_faster_configs() -> None:
    g = torch.Generator(device="cpu").manual_seed(1)
    wq, ws = (t.cuda() for t in fp8.quantize_rows(torch.randn(4096, 4096, generator=g) * 0.02))
    kernels.reset()
    try:
        report = fg.tune([(wq, ws)], torch.bfloat16)
        assert list(report) == ["4096x4096"] and report["4096x4096"].count("M≤") == len(fg.BUCKETS)
        for top, cfg in kernels.fp8_gemm_choices.get((4096, 4096), ()):
            assert cfg is None or cfg in fg.CONFIGS
        REPORT["fp8_gemm_tune_4096x4096"] = report["4096x4096"]
    finally:
        kernels.reset()


def test_a_worker_on_our_gemm_matches_the_library(models) -> None:
    """Eager steps (graphs off: the choice applies to every step as it is made), every FP8 shape forced to one
    config at every M, against the library's GEMM."""
    drv = Driver(runner(models["small"], attention_backend="flashinfer", quantization="fp8", disable_cuda_graph=True))
    shapes = {(mod.quantized()[0].shape[0], mod.quantized()[0].shape[1]) for mod in drv.runner.model.modules()
              if hasattr(mod, "quantized") and mod.quantized()[0].dtype == fp8.FP8}
    saved = dict(kernels.fp8_gemm_choices)
    try:
        kernels.fp8_gemm_choices.clear()
        want = _schedule(drv, 32000)
        drv = Driver(runner(models["small"], attention_backend="flashinfer", quantization="fp8",
                            disable_cuda_graph=True))
        kernels.fp8_gemm_choices.clear()
        kernels.fp8_gemm_choices.update({s: ((max(fg.BUCKETS), fg.CONFIGS[1]),) for s in shapes})
        got = _schedule(drv, 32000)
    finally:
        kernels.fp8_gemm_choices.clear()
        kernels.fp8_gemm_choices.update(saved)
    errs = [rel_err(a, b) for a, b in zip(got, want, strict=True)]
    REPORT["fp8_gemm_worker_vs_library"] = max(errs)
    assert max(errs) < 1e-2, errs
