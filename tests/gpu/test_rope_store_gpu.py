"""The fused rope + K/V write on the GPU (skipped without CUDA): its start-up check passes, and it
writes what FlashInfer's rope followed by the pool's write does (the path it replaces), bf16.

    python -m pytest -q -m gpu tests/gpu/test_rope_store_gpu.py
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("t", [13, 64, 1000])  # a head a program (decode sizes); token blocks (prefill sizes)
def test_rope_store_agrees_with_flashinfer_rope_then_the_write(t) -> None:
    from services.worker.kernels import rope_store as rs
    from services.worker.kernels.ops import flashinfer_ops
    from services.worker.models.rotary import RopeConfig, RotaryEmbedding

    dev = torch.device("cuda")
    assert rs.check(dev)
    hq, hkv, d = 32, 8, 128
    cos_sin = RotaryEmbedding(d, 4096, RopeConfig(theta=500000.0)).cos_sin.to(dev)
    g = torch.Generator(device="cpu").manual_seed(0)
    positions = torch.randint(0, 4096, (t,), generator=g).to(dev)
    slots = torch.randperm(2000, generator=g)[:t].to(dev)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g).to(torch.bfloat16).to(dev)

    def views(x):
        return (x[:, : hq * d].unflatten(-1, (hq, d)), x[:, hq * d: (hq + hkv) * d].unflatten(-1, (hkv, d)),
                x[:, (hq + hkv) * d:].unflatten(-1, (hkv, d)))

    fused, ref = qkv.clone(), qkv.clone()
    caches = [torch.zeros(2000, hkv, d, dtype=torch.bfloat16, device=dev) for _ in range(4)]
    rs.rope_store(*views(fused), caches[0], caches[1], slots, cos_sin, positions)
    q, k, v = views(ref)
    q, k = flashinfer_ops().rope(cos_sin, positions, torch.bfloat16)(q, k)
    caches[2].index_copy_(0, slots, k)
    caches[3].index_copy_(0, slots, v)
    for got, want in ((fused, ref), (caches[0], caches[2]), (caches[1], caches[3])):
        diff = (got.float() - want.float()).abs()
        assert (diff <= want.float().abs() * 2**-7 + 1e-6).all()  # one bf16 rounding at most
        assert (diff > 0).float().mean() < 0.01  # and nearly always the same bits
