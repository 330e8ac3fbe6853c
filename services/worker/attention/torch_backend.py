"""Reference attention in plain PyTorch (any device): one masked attention per request."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.worker.attention.base import AttentionBackend, AttentionBatch
from services.worker.kv_pool import KVPool


@dataclass(frozen=True)
class _Request:
    tokens: slice  # its new tokens in the step's (T, ...) tensors
    slots: torch.Tensor  # (L,) int64: KV slots of positions 0..L-1, L = prefix + extend
    causal: torch.Tensor  # (E, L) bool: new token i (position prefix + i) sees positions <= its own


class TorchAttention(AttentionBackend):
    def __init__(self, pool: KVPool) -> None:
        self.pool = pool
        self._out_slots = torch.empty(0, dtype=torch.int64, device=pool.device)
        self._requests: list[_Request] = []

    def prepare(self, batch: AttentionBatch) -> None:
        self._out_slots = batch.out_slots
        self._requests = []
        start = 0
        rows = batch.rows.tolist()
        for row, prefix, extend in zip(rows, batch.prefix_lens_cpu, batch.extend_lens_cpu, strict=True):
            total = prefix + extend
            key_pos = torch.arange(total, device=self.pool.device)  # (L,)
            self._requests.append(
                _Request(
                    tokens=slice(start, start + extend),
                    slots=batch.req_to_token[row, :total].long(),
                    causal=key_pos[None, :] <= key_pos[prefix:, None],
                )
            )
            start += extend

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
        k_cache, v_cache = self.pool.k[layer], self.pool.v[layer]  # (S, Hkv, D)
        k_cache.index_copy_(0, self._out_slots, k.to(k_cache.dtype))
        v_cache.index_copy_(0, self._out_slots, v.to(v_cache.dtype))
        out = torch.empty_like(q)  # (T, Hq, D)
        for r in self._requests:
            out[r.tokens] = _attend(q[r.tokens], k_cache[r.slots], v_cache[r.slots], r.causal)
        return out


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """q (E, Hq, D), k/v (L, Hkv, D), mask (E, L) -> (E, Hq, D); GQA, float32 softmax."""
    e, hq, d = q.shape
    hkv = k.shape[1]
    qg = q.float().view(e, hkv, hq // hkv, d)  # (E, Hkv, G, D): q head h reads kv head h // G
    scores = torch.einsum("ekgd,lkd->kgel", qg, k.float()) * d**-0.5  # (Hkv, G, E, L)
    probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    out = torch.einsum("kgel,lkd->ekgd", probs, v.float())  # (E, Hkv, G, D)
    return out.reshape(e, hq, d).to(q.dtype)
