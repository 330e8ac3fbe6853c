"""An FP8 pool's values widened to fp16 by integer work in the Triton decode (``triton_decode._widen_e4m3``:
"int" per value, "asm" four at a time with byte permutes) against the conversion instruction ("cvt"), on the
GPU (skipped without CUDA): every e4m3 bit pattern but NaN's, subnormals included, gives the same attention
output — the same products, 2^8 apart, the 2^8 folded back into the scales — at batch 1 (split contexts) and 64,
eager and from a CUDA graph.

    python -m pytest -q -m gpu tests/gpu/test_fp8_widen_gpu.py
"""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("batch", [1, 64])
def test_integer_widening_gives_the_conversions_outputs(batch) -> None:
    from services.worker.attention import triton_decode as td

    dev, hq, hkv, d, ctx = torch.device("cuda"), 32, 8, 128, 700
    g = torch.Generator(device="cpu").manual_seed(batch)
    slots = batch * ctx + 1
    raw = torch.randint(0, 256, (2, slots, hkv, d), generator=g, dtype=torch.uint8)
    raw[(raw & 0x7F) == 0x7F] = 0x3C  # (no NaN pattern: the pool's writes clamp to ±448)
    raw[:, :64] = (torch.arange(64 * hkv * d) % 16).view(64, hkv, d).to(torch.uint8)  # subnormals, zeros
    k8, v8 = (raw[i].to(dev).view(torch.float8_e4m3fn) for i in range(2))
    table = (torch.randperm(slots - 1, generator=g)[: batch * ctx] + 1).view(batch, ctx).to(torch.int32).to(dev)
    rows = torch.arange(batch, device=dev)
    prefix = torch.randint(ctx // 2, ctx, (batch,), generator=g).to(dev)
    q = (torch.randn(batch, hq, d, generator=g) * 0.1).to(torch.bfloat16).to(dev)

    def run(widen):
        return td.decode(q, k8, v8, table, rows, prefix, 1 / math.sqrt(d), 0.7, 1.3, f16=True, widen=widen)

    want = run("cvt").float()
    for widen in ("int", "asm"):
        got = run(widen).float()
        assert torch.equal(got, want), (widen, (got - want).abs().max())
    graph, out = torch.cuda.CUDAGraph(), None
    with torch.cuda.graph(graph):
        out = run("asm")
    q.copy_((torch.randn(batch, hq, d, generator=g) * 0.1).to(torch.bfloat16))
    graph.replay()
    assert torch.equal(out.float(), run("cvt").float())
