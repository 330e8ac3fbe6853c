"""Reference attention in plain PyTorch (any device): one masked attention per request, and per
shared-prefix group (cascade) one unmasked attention of the members' new tokens over the shared
KV, merged with each member's attention over its own positions. An FP8 pool is read dequantized."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.worker.attention.base import AttentionBackend, AttentionBatch, merge_states
from services.worker.kv_pool import KVPool


@dataclass(frozen=True)
class _Request:
    tokens: slice  # its new tokens in the step's (T, ...) tensors
    slots: torch.Tensor  # (L,) int64: KV slots of the positions it attends to itself (skip..prefix+extend-1)
    causal: torch.Tensor  # (E, L) bool: new token i (position prefix + i) sees positions <= its own


@dataclass(frozen=True)
class _Group:
    tokens: torch.Tensor  # (Tg,) int64: its members' new tokens
    slots: torch.Tensor  # (P,) int64: KV slots of the shared prefix


class TorchAttention(AttentionBackend):
    def __init__(self, pool: KVPool) -> None:
        self.pool = pool
        self._out_slots = torch.empty(0, dtype=torch.int64, device=pool.device)
        self._requests: list[_Request] = []
        self._groups: list[_Group] = []

    def prepare(self, batch: AttentionBatch) -> None:
        self._out_slots = batch.out_slots
        self._requests, self._groups = [], []
        c = batch.cascade
        skips = c.skip.tolist() if c is not None else [0] * batch.num_reqs
        start = 0
        rows = batch.rows.tolist()
        for row, prefix, extend, skip in zip(rows, batch.prefix_lens_cpu, batch.extend_lens_cpu, skips, strict=True):
            total = prefix + extend
            key_pos = torch.arange(skip, total, device=self.pool.device)  # (L,)
            query_pos = torch.arange(prefix, total, device=self.pool.device)  # (E,)
            self._requests.append(
                _Request(
                    tokens=slice(start, start + extend),
                    slots=batch.req_to_token[row, skip:total].long(),
                    causal=key_pos[None, :] <= query_pos[:, None],
                )
            )
            start += extend
        if c is not None:
            bounds = [0, *c.qo_lens.cumsum().tolist()]
            for g, (row, n) in enumerate(zip(c.first_rows.tolist(), c.lens.tolist(), strict=True)):
                self._groups.append(_Group(tokens=c.q_index_dev[bounds[g]:bounds[g + 1]],
                                           slots=batch.req_to_token[row, :n].long()))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, rope=None,
                written: bool = False) -> torch.Tensor:
        q, k = self._write(layer, q, k, v, rope, written)
        read = self.pool.read  # (layer, slots) -> K, V (L, Hkv, D), dequantized when FP8
        if not self._groups:
            out = torch.empty_like(q)  # (T, Hq, D)
            for r in self._requests:
                out[r.tokens] = _attend(q[r.tokens], *read(layer, r.slots), r.causal, False)[0].to(q.dtype)
            return out
        out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)  # (T, Hq)
        for r in self._requests:
            out[r.tokens], lse[r.tokens] = _attend(q[r.tokens], *read(layer, r.slots), r.causal)
        for g in self._groups:  # the shared prefix, once per group
            o0, l0 = _attend(q[g.tokens], *read(layer, g.slots), None)
            out[g.tokens], lse[g.tokens] = merge_states(out[g.tokens], lse[g.tokens], o0, l0)
        return out.to(q.dtype)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
            want_lse: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q (E, Hq, D), k/v (L, Hkv, D), mask (E, L) or None (all visible) -> output (E, Hq, D) and
    log-sum-exp of the scores (E, Hq) (None without ``want_lse``), float32; GQA."""
    e, hq, d = q.shape
    hkv = k.shape[1]
    qg = q.float().view(e, hkv, hq // hkv, d)  # (E, Hkv, G, D): q head h reads kv head h // G
    scores = torch.einsum("ekgd,lkd->kgel", qg, k.float()) * d**-0.5  # (Hkv, G, E, L)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = scores.softmax(dim=-1)
    out = torch.einsum("kgel,lkd->ekgd", probs, v.float())  # (E, Hkv, G, D)
    if not want_lse:
        return out.reshape(e, hq, d), None
    lse = torch.logsumexp(scores, dim=-1)  # (Hkv, G, E)
    return out.reshape(e, hq, d), lse.permute(2, 0, 1).reshape(e, hq)
