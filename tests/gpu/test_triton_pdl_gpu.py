"""The Triton kernels launched overlapping the kernel before them (PDL, ``kernels/triton_pdl.py``) on the GPU
(skipped without CUDA): a decode layer's chain — the PDL-launched CUDA q/k/v linear, the rope + K/V write, the
decode attention, the PDL-launched o linear — captured in a CUDA graph and replayed with new inputs each time
gives the same bits as the chain launched eagerly without PDL, and the write of the new token's K/V is what
the attention reads (a missing wait would read the pool or q before the kernel before has written them).

    python -m pytest -q -m gpu tests/gpu/test_triton_pdl_gpu.py
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

HQ, HKV, D, HIDDEN, CTX = 8, 2, 128, 1024, 700


def _pdl(monkeypatch, on: bool) -> None:
    from services.worker.kernels import triton_pdl

    monkeypatch.setenv("BANYAN_TRITON_PDL", "1" if on else "0")
    triton_pdl._supported.cache_clear()


@pytest.mark.parametrize("batch", [1, 4])
def test_the_layer_chain_replayed_with_pdl_equals_it_launched_without(monkeypatch, batch) -> None:
    from services.worker.attention import triton_decode as td
    from services.worker.kernels import cuda_gemv, rope_store, triton_pdl
    from services.worker.models.rotary import RopeConfig, RotaryEmbedding

    dev = torch.device("cuda")
    if torch.cuda.get_device_capability()[0] >= 9:  # (Hopper: the launches really overlap)
        _pdl(monkeypatch, True)
        assert triton_pdl.launch_pdl(dev), "Triton here has no launch_pdl option"
    if cuda_gemv.library(True) is None:
        pytest.fail(f"cuda gemv: {cuda_gemv.unavailable(True)}")
    cfg = next(c for c in cuda_gemv.CONFIGS if c.pdl and c.pipe)
    g = torch.Generator(device="cpu").manual_seed(batch)
    w_qkv = (torch.randn((HQ + 2 * HKV) * D, HIDDEN, generator=g) * 0.03).to(torch.bfloat16).to(dev)
    w_o = (torch.randn(HIDDEN, HQ * D, generator=g) * 0.03).to(torch.bfloat16).to(dev)
    cos_sin = RotaryEmbedding(D, 4096, RopeConfig(theta=500000.0)).cos_sin.to(dev)
    slots_n = batch * (CTX + 40) + 1
    table = torch.randperm(slots_n - 1, generator=g)[: batch * (CTX + 40)].view(batch, CTX + 40).to(torch.int32)
    table = table.to(dev)
    rows = torch.arange(batch, dtype=torch.int64, device=dev)
    caches0 = [(torch.randn(slots_n, HKV, D, generator=g) * 2).to(torch.bfloat16).to(dev) for _ in range(2)]

    def layer(x, pos, caches):
        qkv = cuda_gemv.linear(x, w_qkv, None, cfg)
        q = qkv[:, : HQ * D].unflatten(-1, (HQ, D))
        k = qkv[:, HQ * D: (HQ + HKV) * D].unflatten(-1, (HKV, D))
        v = qkv[:, (HQ + HKV) * D:].unflatten(-1, (HKV, D))
        slots = table.gather(1, pos[:, None].to(torch.int64)).view(-1).to(torch.int64)
        rope_store.rope_store(q, k, v, caches[0], caches[1], slots, cos_sin, pos)
        o = td.decode(q, caches[0], caches[1], table, rows, pos, D ** -0.5)
        return cuda_gemv.linear(o.flatten(1), w_o, None, cfg)

    inputs = [((torch.randn(batch, HIDDEN, generator=g) * 4).to(torch.bfloat16).to(dev),
               torch.randint(CTX - 50, CTX + 30, (batch,), generator=g).to(dev)) for _ in range(12)]
    # with PDL (where the device has it), in a graph: static inputs and pool, new values each replay
    x_s, pos_s = inputs[0][0].clone(), inputs[0][1].clone()
    caches_s = [c.clone() for c in caches0]
    td.warm_up(torch.bfloat16, torch.bfloat16, (HQ, HKV, D), dev)
    for _ in range(2):  # (compile outside the capture)
        layer(x_s, pos_s, caches_s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_s = layer(x_s, pos_s, caches_s)
    got = []
    for x, pos in inputs:
        for s, c in zip(caches_s, caches0, strict=True):
            s.copy_(c)
        x_s.copy_(x)
        pos_s.copy_(pos)
        graph.replay()
        got.append((y_s.clone(), caches_s[0].clone(), caches_s[1].clone()))
    torch.cuda.synchronize()
    # without PDL, eagerly
    _pdl(monkeypatch, False)
    assert not triton_pdl.launch_pdl(dev)
    for (x, pos), (y, kc, vc) in zip(inputs, got, strict=True):
        caches = [c.clone() for c in caches0]
        want = layer(x, pos, caches)
        torch.cuda.synchronize()
        assert torch.equal(kc, caches[0]) and torch.equal(vc, caches[1])
        assert torch.equal(y, want), (y.float() - want.float()).abs().max().item()
