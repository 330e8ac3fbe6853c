"""Attention batches with shared-prefix groups over a random KV pool, for the CPU reference test
(tests/scheduler/test_cascade.py) and the FlashInfer one (tests/gpu/test_gpu_parity.py)."""

from __future__ import annotations

import numpy as np
import torch

from services.worker.attention.base import AttentionBatch, make_cascade
from services.worker.kv_pool import KVPool

# name -> per request (prefix, extend, group); groups' shared lengths in SHARED
CASES = {
    "decode": [(700, 1, 0), (650, 1, 0), (512, 1, 0), (300, 1, -1), (900, 1, 1), (800, 1, 1), (5, 1, -1)],
    "mixed": [(700, 1, 0), (512, 40, 0), (600, 1, 0), (0, 33, -1), (900, 1, 1), (256, 300, 1)],
    "exact_prefix": [(512, 1, 0), (512, 1, 0), (512, 3, 0)],  # members' own part is just their new tokens
    "prefill_only": [(512, 20, 0), (600, 40, 0), (0, 50, -1), (100, 7, -1)],
    "fresh": [(0, 30, -1), (0, 5, -1), (0, 1, -1)],  # no KV before the step, no groups
    # members first, group by group (as the scheduler orders a grouped batch): queries read in place
    "decode_leading": [(700, 1, 0), (650, 1, 0), (512, 1, 0), (900, 1, 1), (800, 1, 1), (300, 1, -1), (5, 1, -1)],
    "mixed_leading": [(700, 1, 0), (512, 40, 0), (900, 1, 1), (256, 300, 1), (0, 33, -1)],
    # the decodes first (as the scheduler orders an ungrouped step): the backend's parts write one output in place
    "mixed_decodes_first": [(700, 1, 0), (600, 1, 0), (900, 1, 1), (5, 1, -1), (512, 40, 0), (0, 33, -1),
                            (256, 300, 1)],
}
GROUPED = [name for name, reqs in CASES.items() if any(g >= 0 for _, _, g in reqs)]
SHARED = [512, 256]  # group 0 shares positions 0..511, group 1 0..255


def build(name: str, hq: int, hkv: int, d: int, dtype: torch.dtype, device: str,
          seed: int = 0) -> tuple[KVPool, AttentionBatch, AttentionBatch, tuple[torch.Tensor, ...]]:
    """(pool, the batch without groups, the same batch with them, (q, k, v) of its new tokens).
    Members of a group hold the same slots for the shared positions, as requests under one radix
    node do; everything else is distinct."""
    reqs = CASES[name]
    g = torch.Generator().manual_seed(seed)
    ctx = 1024
    n = len(reqs)
    slots = (torch.randperm(n * ctx + 4096, generator=g)[: n * ctx] + 1).view(n, ctx)
    for grp, shared in enumerate(SHARED):
        members = [i for i, (_, _, gi) in enumerate(reqs) if gi == grp]
        for i in members[1:]:
            slots[i, :shared] = slots[members[0], :shared]
    pool = KVPool(1, n * ctx + 4096 + 1, hkv, d, dtype, device)
    pool.k[0].copy_(torch.randn(pool.k[0].shape, generator=g).to(dtype))
    pool.v[0].copy_(torch.randn(pool.v[0].shape, generator=g).to(dtype))
    table = torch.zeros(n + 1, ctx, dtype=torch.int32)
    table[:n] = slots.int()
    table = table.to(device)
    prefix = [p for p, _, _ in reqs]
    extend = [e for _, e, _ in reqs]
    rows = torch.arange(n, device=device)
    positions = torch.cat([torch.arange(p, p + e) for p, e, _ in reqs]).to(device)
    out_slots = table[rows.repeat_interleave(torch.tensor(extend, device=device)), positions].long()
    common = dict(req_to_token=table, rows=rows, prefix_lens=torch.tensor(prefix, device=device),
                  extend_lens=torch.tensor(extend, device=device), out_slots=out_slots, positions=positions,
                  prefix_lens_cpu=prefix, extend_lens_cpu=extend)
    used = sorted({gi for _, _, gi in reqs if gi >= 0})
    cascade = make_cascade(np.array([gi for _, _, gi in reqs]), np.array([SHARED[i] for i in used]),
                           np.arange(n), np.array(extend), torch.device(device)) if used else None
    t = positions.numel()
    qkv = (torch.randn(t, hq, d, generator=g).to(dtype).to(device),
           torch.randn(t, hkv, d, generator=g).to(dtype).to(device),
           torch.randn(t, hkv, d, generator=g).to(dtype).to(device))
    return pool, AttentionBatch(**common), AttentionBatch(**common, cascade=cascade), qkv
