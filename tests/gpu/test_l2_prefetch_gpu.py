"""The Triton decode attention prefetching the next weight into L2 (``triton_decode.decode(prefetch=...)``,
``kernels.attention_l2``) on the GPU (skipped without CUDA): a hint only — the outputs are the bits of the same
launch without it, eagerly and replayed from a CUDA graph, for one and several requests, short contexts (programs
without tokens issue nothing) and byte counts that split unevenly over the programs. That the instruction is in
the compiled kernel: tests/worker/test_triton_decode_ptx.py (on the CPU).

    python -m pytest -q -m gpu tests/gpu/test_l2_prefetch_gpu.py
"""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

HQ, HKV, D = 32, 8, 128


@pytest.mark.parametrize("batch,ctx,nbytes", [(1, 1000, 16 << 20), (1, 100, 4096 * 16 + 48), (4, 700, 8 << 20)])
def test_the_prefetching_decode_gives_the_same_bits_eagerly_and_in_a_graph(batch, ctx, nbytes) -> None:
    from services.worker.attention import triton_decode as td

    dev = torch.device("cuda")
    g = torch.Generator(device="cpu").manual_seed(batch + ctx)
    slots = batch * ctx + 1
    k, v = ((torch.randn(slots, HKV, D, generator=g) * 2).to(torch.bfloat16).to(dev) for _ in range(2))
    table = torch.randperm(slots - 1, generator=g)[: batch * ctx].view(batch, ctx).to(torch.int32).to(dev)
    rows = torch.arange(batch, dtype=torch.int64, device=dev)
    prefix = torch.randint(ctx // 2, ctx, (batch,), generator=g).to(dev)
    q = torch.randn(batch, HQ, D, generator=g).to(torch.bfloat16).to(dev)
    weight = torch.randn((16 << 20) // 2 + 64, generator=g).to(torch.bfloat16).to(dev).view(torch.uint8)
    pf = (weight, nbytes)
    want = td.decode(q, k, v, table, rows, prefix, 1 / math.sqrt(D))
    got = td.decode(q, k, v, table, rows, prefix, 1 / math.sqrt(D), prefetch=pf)
    torch.cuda.synchronize()
    assert torch.equal(got, want)
    out = torch.empty_like(want)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        td.decode(q, k, v, table, rows, prefix, 1 / math.sqrt(D), prefetch=pf, out=out)
    for step in range(3):  # (new queries and lengths each replay)
        q.copy_(torch.randn(batch, HQ, D, generator=g).to(torch.bfloat16))
        prefix.copy_(torch.randint(1, ctx, (batch,), generator=g))
        graph.replay()
        assert torch.equal(out, td.decode(q, k, v, table, rows, prefix, 1 / math.sqrt(D))), step

