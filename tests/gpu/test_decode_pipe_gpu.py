"""The pipelined Triton decode on the GPU (skipped without CUDA): each block's table slots loaded an iteration
ahead (Triton then keeps stages − 1 K/V buffers in flight) gives the same bits as the same launch without —
bf16 and FP8 pools, at batch 1 (split contexts), 64 (the pipelined band) and 600 rows, with 32- and 64-token
blocks at 3 and 4 stages, eagerly and replayed from a CUDA graph — and the served launch in the band (one split
on a bf16 pool) agrees with the launch before it (``BANYAN_DECODE_PIPE=0``) to rounding.

    python -m pytest -q -m gpu tests/gpu/test_decode_pipe_gpu.py
"""

from __future__ import annotations

import math

import pytest
import torch

from shared import knobs as registry

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture
def rule(monkeypatch):
    from services.worker.attention import decode_rules as dr

    def turn(pipe: str | None) -> None:
        if pipe is None:
            monkeypatch.delenv("BANYAN_DECODE_PIPE", raising=False)
        else:
            monkeypatch.setenv("BANYAN_DECODE_PIPE", pipe)
        registry.reload()

    turn(None)
    yield turn
    monkeypatch.delenv("BANYAN_DECODE_PIPE", raising=False)
    registry.reload()


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("batch", [1, 64, 600])
def test_the_slots_a_block_ahead_give_the_same_launchs_bits(rule, batch, fp8) -> None:
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

    served = td.launch_config(batch, hkv, fp8)
    assert served.pipe == (batch == 64)  # (the bands: 32-96 rows of 8 KV heads; on an FP8 pool 32-66, 101-132)
    for kw in ({"block": served.block, "num_stages": served.stages}, {"block": 32, "num_stages": 3},
               {"block": 64, "num_stages": 4}):  # (the same launch either way)
        want, want_lse = run(splits=served.splits, num_warps=served.warps, pipe=False, **kw)
        got, lse = run(splits=served.splits, num_warps=served.warps, pipe=True, **kw)
        assert torch.equal(got, want) and torch.equal(lse, want_lse), (kw, (got.float() - want.float()).abs().max())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, _ = run()  # (the served launch)
    q.copy_((torch.randn(batch, hq, d, generator=g, device=dev) * 0.1).to(torch.bfloat16))
    graph.replay()
    assert torch.equal(out, run(pipe=not served.pipe, splits=served.splits, block=served.block,
                                num_warps=served.warps, num_stages=served.stages)[0])
    rule("0")  # (the launch before the band: another split count, so equal to rounding only)
    before = td.launch_config(batch, hkv, fp8)
    assert before.pipe is False and (before == served) == (batch != 64)
    old = run()[0].float()
    assert (out.float() - old).abs().max() <= 2e-2 * old.abs().max(), (out.float() - old).abs().max()
