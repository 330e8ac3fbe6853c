"""A FlashInfer plan must not overwrite the pinned buffer the previous step's plan is still to be
copied from (skipped without CUDA + FlashInfer).

FlashInfer writes a plan on the host into its wrapper's page-locked buffer and queues the copy to
the device on the stream without waiting for it. Under overlap scheduling the next step is planned
while the previous one is queued; when that step's stream is held up (here by a sleeping kernel;
in W2 with the host KV tier, by waits for tier copies) its copy runs after the next plan was
written, and the step runs with the wrong plan. ``FlashInferAttention.prepare``/``prepare_graph``
wait for the previous plan's copy first (one fence for both); checked on the eager plans, whose
content differs from step to step (a graph's fixed-size plan may not)."""

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


def make_batch(table: torch.Tensor, reqs: list[tuple[int, int, int]]) -> AttentionBatch:
    """(row, prefix, extend) per request → the batch (its new tokens' slots from the table)."""
    rows = torch.tensor([r for r, _, _ in reqs], device="cuda")
    prefix, extend = [p for _, p, _ in reqs], [e for _, _, e in reqs]
    positions = torch.cat([torch.arange(p, p + e) for _, p, e in reqs]).cuda()
    out_slots = table[rows.repeat_interleave(torch.tensor(extend, device="cuda")), positions].long()
    return AttentionBatch(req_to_token=table, rows=rows, prefix_lens=torch.tensor(prefix, device="cuda"),
                          extend_lens=torch.tensor(extend, device="cuda"), out_slots=out_slots, positions=positions,
                          prefix_lens_cpu=prefix, extend_lens_cpu=extend)


def qkv(n: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(n, h, D, dtype=torch.bfloat16, device="cuda", generator=g) for h in (HQ, HKV, HKV))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


CASES = {  # two steps whose plans differ (lengths, hence work split and tiles), on distinct table rows
    "decode": ([(0, 37, 1), (1, 1500, 1), (2, 1, 1), (3, 1000, 1)], [(4, 2000, 1), (5, 5, 1), (6, 700, 1)]),
    "prefill": ([(0, 100, 300), (1, 7, 9)], [(4, 1000, 17), (5, 50, 500), (6, 3, 1)]),  # paged, as W2's chunks
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_next_plan_waits_for_the_previous_plans_copy(case) -> None:
    from services.worker.attention.flashinfer_backend import FlashInferAttention

    torch.manual_seed(0)
    pool = KVPool(1, 20000, HKV, D, torch.bfloat16, "cuda")
    pool.k[0].normal_(), pool.v[0].normal_()
    table = torch.zeros(9, 2048, dtype=torch.int32, device="cuda")
    table[:8] = (torch.randperm(19999, device="cuda")[: 8 * 2048] + 1).view(8, 2048).int()
    a, b = (make_batch(table, reqs) for reqs in CASES[case])
    (qa, ka, va), (qb, kb, vb) = qkv(a.positions.numel(), 1), qkv(b.positions.numel(), 2)
    ref = TorchAttention(pool)
    ref.prepare(a)
    want_a = ref.forward(qa, ka, va, 0)
    ref.prepare(b)
    want_b = ref.forward(qb, kb, vb, 0)

    fi = FlashInferAttention(pool, HQ)
    fi.prepare(a)  # (first use: module loading and lazy buffers out of the timed part)
    fi.forward(qa, ka, va, 0)
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)  # the stream is busy: step A's plan copy waits behind this
    fi.prepare(a)
    out_a = fi.forward(qa, ka, va, 0)
    fi.prepare(b)  # unfenced, this rewrote A's plan on the host before A's copy ran
    out_b = fi.forward(qb, kb, vb, 0)
    torch.cuda.synchronize()
    assert rel_err(out_a, want_a) < 1e-2 and rel_err(out_b, want_b) < 1e-2
