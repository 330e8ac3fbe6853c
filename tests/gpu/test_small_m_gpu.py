"""The decode-size linear kernel on the GPU (skipped without CUDA): every config, bf16 and e4m3
weights, M 1–16, against float32 on the dequantized weight; ``tune`` records a choice only where the kernel was
correct and faster, and a layer then uses it inside a CUDA graph with the same result.

    python -m pytest -q -m gpu tests/gpu/test_small_m_gpu.py
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_every_config_matches_the_library_on_the_device() -> None:
    from services.worker.kernels import small_m as sm
    from services.worker.quant.fp8 import library_fp8_linear, quantize_rows

    g = torch.Generator(device="cpu").manual_seed(0)
    for n, k in ((4096, 4096), (1000, 3000)):
        w = (torch.randn(n, k, generator=g) * 0.02).to(torch.bfloat16)
        q, s = (t.cuda() for t in quantize_rows(w.float()))
        w = w.cuda()
        for m in (1, 5, 16):
            x = torch.randn(m, k, generator=g).to(torch.bfloat16).cuda()
            want = F.linear(x.float(), w.float())
            want_q = x.float() @ q.float().t() * s
            for cfg in sm.CONFIGS:
                h = torch.randn(m, 2 * k, generator=g).to(torch.bfloat16).cuda()  # [gate | up]
                act = (F.silu(h[:, :k].float()) * h[:, k:].float()).to(torch.bfloat16)
                fused = sm.linear(h, w, None, cfg, silu_mul=True).float()
                assert torch.allclose(fused, F.linear(act.float(), w.float()), rtol=2e-2, atol=2e-2), (n, k, m, cfg)
                got = sm.linear(x, w, None, cfg)
                assert got.dtype == torch.bfloat16 and got.shape == (m, n)
                assert torch.allclose(got.float(), want, rtol=2e-2, atol=2e-2), (n, k, m, cfg)
                assert torch.allclose(sm.linear(x, q, s, cfg).float(), want_q, rtol=2e-2, atol=2e-2), (n, k, m, cfg)
                if cfg.last_adds:  # the tile's last program adds the parts: the second kernel's bits, every time
                    two = sm.linear(x, q, s, sm.Config(**{**cfg.__dict__, "last_adds": False}))
                    assert all(torch.equal(sm.linear(x, q, s, cfg), two) for _ in range(200)), (n, k, m, cfg)
            assert (library_fp8_linear(x, q, s).float() - want_q).abs().max() < 0.2 * want_q.abs().max()


def test_tune_records_only_correct_faster_choices_and_graphs_replay_them() -> None:
    from services.worker import kernels
    from services.worker.kernels import small_m as sm
    from services.worker.models.layers import ColumnParallelLinear
    from services.worker.tp import TPGroup

    kernels.reset()
    try:
        lin = ColumnParallelLinear(4096, 6144, bias=False, tp=TPGroup()).cuda().to(torch.bfloat16)
        lin.weight.data.normal_(0, 0.02)
        report = sm.tune([(lin.weight, None)], lambda x, w, s: F.linear(x, w), torch.bfloat16)
        assert list(report) == ["6144x4096 bfloat16"]
        chosen = kernels.choices.get((6144, 4096, torch.bfloat16))
        parts = [p.split(": ", 1)[1] for p in report["6144x4096 bfloat16"].split("; ")]
        assert len(parts) == len(kernels.BUCKETS)
        assert (chosen is not None) == any(not p.startswith("library") for p in parts)
        x = torch.randn(1, 4096, dtype=torch.bfloat16, device="cuda")
        out = torch.empty(1, 6144, dtype=torch.bfloat16, device="cuda")
        eager = lin(x)
        graph = torch.cuda.CUDAGraph()
        with torch.inference_mode():
            lin(x)
            torch.cuda.synchronize()
            with torch.cuda.graph(graph):
                out.copy_(lin(x))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
        assert torch.allclose(eager.float(), F.linear(x, lin.weight).float(), rtol=2e-2, atol=2e-2)
    finally:
        kernels.reset()
