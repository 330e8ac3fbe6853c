"""``BANYAN_DECODE_PIPE=1`` on the GPU (skipped without CUDA): the Triton decode with each block's table slots
loaded an iteration ahead (Triton then keeps stages − 1 K/V copies in flight) gives the same bits as the served
launch — bf16 and FP8 pools, at batch 1 (split contexts), 64 and 600 rows, with 32- and 64-token blocks at 3 and
4 stages, eagerly and replayed from a CUDA graph.

    python -m pytest -q -m gpu tests/gpu/test_decode_pipe_gpu.py
"""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture
def pipe(monkeypatch):
    from services.worker.attention import decode_rules as dr

    def turn(on: bool) -> None:
        monkeypatch.setenv("BANYAN_DECODE_PIPE", "1" if on else "0")
        dr.pipelined.cache_clear()
        dr.plain_stages.cache_clear()

    yield turn
    monkeypatch.delenv("BANYAN_DECODE_PIPE", raising=False)
    dr.pipelined.cache_clear()
    dr.plain_stages.cache_clear()


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("batch", [1, 64, 600])
def test_the_slots_a_block_ahead_give_the_served_launchs_bits(pipe, batch, fp8) -> None:
    from services.worker.attention import triton_decode as td

    dev, hq, hkv, d = torch.device("cuda"), 32, 8, 128
    ctx = 1100 if batch <= 64 else 300
    g = torch.Generator(device=dev).manual_seed(batch + fp8)
    slots = batch * ctx + 1
    k, v = (torch.randn(slots, hkv, d, generator=g, device=dev).to(torch.float8_e4m3fn if fp8 else torch.bfloat16)
            for _ in range(2))
    table = (torch.randperm(slots - 1, generator=g, device=dev)[: batch * ctx] + 1).view(batch, ctx).to(torch.int32)
    rows = torch.arange(batch, device=dev)
    prefix = torch.randint(ctx // 3, ctx, (batch,), generator=g, device=dev)
    q = (torch.randn(batch, hq, d, generator=g, device=dev) * 0.1).to(torch.bfloat16)

    def run(**kw):
        return td.decode(q, k, v, table, rows, prefix, 1 / math.sqrt(d), 0.7, 1.3, f16=fp8, return_lse=True, **kw)

    for kw in ({}, {"block": 32, "num_stages": 3}, {"block": 64, "num_stages": 4}):  # (the same launch either way)
        pipe(False)
        want, want_lse = run(**kw)
        pipe(True)
        got, lse = run(**kw)
        assert torch.equal(got, want) and torch.equal(lse, want_lse), (kw, (got.float() - want.float()).abs().max())
    pipe(True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, _ = run()
    q.copy_((torch.randn(batch, hq, d, generator=g, device=dev) * 0.1).to(torch.bfloat16))
    graph.replay()
    pipe(False)
    assert torch.equal(out, run()[0])
