"""A FlashInfer plan must not overwrite the pinned buffer the previous step's plan is still to be
copied from (skipped without CUDA + FlashInfer).

FlashInfer writes a plan on the host into its wrapper's page-locked buffer and queues the copy to
the device on the stream without waiting for it. Under overlap scheduling the next step is planned
while the previous one is queued; when that step's stream is held up (here by a sleeping kernel;
in W2 with the host KV tier, by waits for tier copies) its copy runs after the next plan was
written, and the step runs with the wrong plan. ``FlashInferAttention.prepare``/``prepare_graph``
wait for the previous plan's copy first; both paths are checked: FlashInfer's own ``plan`` and the
graph wrappers' fast re-plan (no host sync at all inside)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from services.worker.attention.base import AttentionBatch
from services.worker.attention.torch_backend import TorchAttention
from services.worker.kv_pool import KVPool

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None, reason="needs FlashInfer"),
]
HQ, HKV, D = 32, 8, 128  # GQA 4: the tensor-core decode (FlashInfer's prefill planner)
SLEEP_CYCLES = 1_000_000_000  # ~0.5 s of a spinning kernel ahead of the first plan's copy


def decode_batch(table: torch.Tensor, rows: list[int], prefix: list[int]) -> AttentionBatch:
    r = torch.tensor(rows, device="cuda")
    p = torch.tensor(prefix, device="cuda")
    return AttentionBatch(req_to_token=table, rows=r, prefix_lens=p, extend_lens=torch.ones_like(p),
                          out_slots=table[r, p].long(), positions=p, prefix_lens_cpu=list(prefix),
                          extend_lens_cpu=[1] * len(rows))


def qkv(n: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(n, h, D, dtype=torch.bfloat16, device="cuda", generator=g) for h in (HQ, HKV, HKV))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("graph", [False, True], ids=["plan", "graph_replan"])
def test_the_next_plan_waits_for_the_previous_plans_copy(graph) -> None:
    from services.worker.attention.flashinfer_backend import FlashInferAttention

    torch.manual_seed(0)
    pool = KVPool(1, 20000, HKV, D, torch.bfloat16, "cuda")
    pool.k[0].normal_(), pool.v[0].normal_()
    table = torch.zeros(9, 2048, dtype=torch.int32, device="cuda")
    table[:8] = (torch.randperm(19999, device="cuda")[: 8 * 2048] + 1).view(8, 2048).int()
    a = decode_batch(table, [0, 1, 2, 3], [37, 1500, 1, 1000])  # different lengths: different plans
    b = decode_batch(table, [4, 5, 6, 7], [2000, 5, 700, 64])
    (qa, ka, va), (qb, kb, vb) = qkv(4, 1), qkv(4, 2)
    ref = TorchAttention(pool)
    ref.prepare(a)
    want_a = ref.forward(qa, ka, va, 0)
    ref.prepare(b)
    want_b = ref.forward(qb, kb, vb, 0)

    fi = FlashInferAttention(pool, HQ)
    if graph:
        fi.init_graph([4], 2048)
        fi.prepare_graph(a, 4)  # the first plan of the size: FlashInfer's own; later ones re-plan fast
        fi.forward(qa, ka, va, 0)
        prepare = lambda batch: fi.prepare_graph(batch, 4)  # noqa: E731
    else:
        prepare = fi.prepare
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)  # the stream is busy: step A's plan copy waits behind this
    prepare(a)
    out_a = fi.forward(qa, ka, va, 0)
    prepare(b)  # unfenced, this rewrote A's plan on the host before A's copy ran
    out_b = fi.forward(qb, kb, vb, 0)
    torch.cuda.synchronize()
    assert rel_err(out_a, want_a) < 1e-2 and rel_err(out_b, want_b) < 1e-2
