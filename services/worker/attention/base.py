"""The attention backend interface and the per-step batch state it reads.

Paged KV layout (page size 1): per layer, ``k`` and ``v`` tensors of shape
(num_slots, num_kv_heads, head_dim). A request's KV lives at the slots listed in its row of the
``req_to_token`` table, in position order. Slot 0 is reserved as padding and never allocated; the
table's last row is the padding row (all zeros: slot 0), never assigned to a request.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np
import torch

from services.worker.hostio import to_device


@dataclass(frozen=True)
class Cascade:
    """Shared-prefix groups of a step (the scheduler's ``cascade_group`` / ``cascade_lens``): the
    members of group g share the KV of positions 0..lens[g]-1, read once for the group (level 0,
    every member's new tokens against it, no mask: all of it precedes them); each request's own
    attention (level 1) reads only positions ``skip`` onwards. The two partial states merge by
    their log-sum-exp."""

    lens: np.ndarray  # (G,) int64: shared prefix length per group
    skip: np.ndarray  # (B,) int64: positions each request reads through its group (0: none)
    first_rows: np.ndarray  # (G,) int64: table row of each group's first member (holds the shared slots)
    qo_lens: np.ndarray  # (G,) int64: new tokens of each group's members
    q_index: np.ndarray  # (Tg,) int64: the members' new tokens (indices into the step's T), group by group
    q_index_dev: torch.Tensor  # the same on the device
    leading: int = 0  # len(q_index) when the members' tokens are the step's first ones (q_index = 0..n-1)


def make_cascade(group: np.ndarray, lens: np.ndarray, rows: np.ndarray, extend: np.ndarray,
                 device: torch.device) -> Cascade:
    """From the scheduler's per-request group (-1: none) and per-group lengths, all on the host."""
    group, lens, extend = group.astype(np.int64), lens.astype(np.int64), extend.astype(np.int64)
    member = np.flatnonzero(group >= 0)
    order = member[np.argsort(group[member], kind="stable")]  # members, group by group, batch order within
    skip = np.where(group >= 0, lens[np.maximum(group, 0)], 0)
    starts = np.cumsum(extend) - extend
    n = extend[order]
    offsets = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
    q_index = np.repeat(starts[order], n) + offsets
    first = order[np.searchsorted(group[order], np.arange(len(lens)))]
    qo_lens = np.bincount(group[member], weights=extend[member], minlength=len(lens)).astype(np.int64)
    leading = len(q_index) if np.array_equal(q_index, np.arange(len(q_index))) else 0
    return Cascade(lens=lens, skip=skip, first_rows=rows[first].astype(np.int64), qo_lens=qo_lens, q_index=q_index,
                   q_index_dev=to_device(q_index, torch.int64, device), leading=leading)


def merge_states(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor,
                 lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over two disjoint key sets A and B, from each one's output (T, H, D) and natural
    log-sum-exp of its scores (T, H) → the output and log-sum-exp over A ∪ B (float32)."""
    m = torch.maximum(lse_a, lse_b)
    wa, wb = torch.exp(lse_a - m), torch.exp(lse_b - m)
    total = wa + wb
    out = (o_a.float() * (wa / total)[..., None]) + (o_b.float() * (wb / total)[..., None])
    return out, m + torch.log(total)


@dataclass
class AttentionBatch:
    """What one model step computes, built once per step by the model runner.

    Requests are in batch order; their new tokens are concatenated in that order (T tokens).
    """

    req_to_token: torch.Tensor  # (R + 1, C) int32, device: slot of each position of each row (+ padding row)
    rows: torch.Tensor  # (B,) int64 device: request-table rows
    prefix_lens: torch.Tensor  # (B,) int64 device: tokens already in KV before this step
    extend_lens: torch.Tensor  # (B,) int64 device: new tokens computed this step
    out_slots: torch.Tensor  # (T,) int64 device: KV slot of each new token
    positions: torch.Tensor  # (T,) int64 device: absolute position of each new token
    prefix_lens_cpu: list[int]
    extend_lens_cpu: list[int]
    cascade: Cascade | None = None  # shared-prefix groups, when the scheduler sent some

    @property
    def num_reqs(self) -> int:
        return len(self.extend_lens_cpu)

    @property
    def is_decode(self) -> bool:
        return all(n == 1 for n in self.extend_lens_cpu)


class AttentionBackend(ABC):
    """Writes the new tokens' K/V into the pool and computes attention for them.

    Backends that can run under CUDA graphs also implement the ``*_graph`` methods: graphs are
    captured for pure-decode batches of fixed sizes, padded with rows that read and write slot 0.
    """

    supports_cuda_graph: bool = False

    def kernel_map(self) -> list:
        """Which kernel each kind of step runs (``kernel_map.attention_map``; logged at start-up): the reference."""
        from services.worker.attention.kernel_map import attention_map

        return attention_map("torch", str(self.pool.dtype).removeprefix("torch."), 0, False, False, 0)

    @abstractmethod
    def prepare(self, batch: AttentionBatch) -> None:
        """Build per-step metadata (index buffers, kernel plans) before the layers run."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, rope=None,
                written: bool = False) -> torch.Tensor:
        """q (T, Hq, D), k/v (T, Hkv, D) of the new tokens → output (T, Hq, D).

        Stores k/v at ``batch.out_slots`` of layer ``layer``, then attends each new token to its
        request's positions 0..its own (causal), prefix included. With ``rope`` (a ``RopeStep``)
        q and k are not rotated yet: the pool's write rotates them (``KVPool.store_rope``: one
        kernel for both where it can). ``written``: q and k are rotated and k/v stored already
        (the piecewise graphs do both): attention only.
        """

    def _write(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope,
               written: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward``'s K/V write into ``self.pool`` at ``self._out_slots`` (rotating q and k first with
        ``rope``; nothing when ``written``) → the (rotated) q and k."""
        if written:
            return q, k
        if rope is None:
            self.pool.store(layer, self._out_slots, k, v)  # (quantized when the pool is FP8)
            return q, k
        return self.pool.store_rope(layer, self._out_slots, q, k, v, rope)  # (one launch where the fused kernel is on)

    def init_graph(self, batch_sizes: list[int], max_context: int) -> None:
        """Allocate the fixed index buffers the graphs of these decode batch sizes read."""
        raise NotImplementedError(f"{type(self).__name__} cannot run under CUDA graphs")

    def prepare_graph(self, batch: AttentionBatch, bs: int) -> None:
        """Like ``prepare`` for a pure-decode batch of at most ``bs`` requests, padded to ``bs``
        rows, into the fixed buffers of the graph of size ``bs``. ``batch.out_slots`` is the
        graph's fixed (bs,) buffer, padding rows already 0."""
        raise NotImplementedError(f"{type(self).__name__} cannot run under CUDA graphs")
