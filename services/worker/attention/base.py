"""The attention backend interface and the per-step batch state it reads.

Paged KV layout (page size 1): per layer, ``k`` and ``v`` tensors of shape
(num_slots, num_kv_heads, head_dim). A request's KV lives at the slots listed in its row of the
``req_to_token`` table, in position order. Slot 0 is reserved as padding and never allocated; the
table's last row is the padding row (all zeros: slot 0), never assigned to a request.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


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

    @abstractmethod
    def prepare(self, batch: AttentionBatch) -> None:
        """Build per-step metadata (index buffers, kernel plans) before the layers run."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
        """q (T, Hq, D), k/v (T, Hkv, D) of the new tokens → output (T, Hq, D).

        Stores k/v at ``batch.out_slots`` of layer ``layer``, then attends each new token to its
        request's positions 0..its own (causal), prefix included.
        """

    def init_graph(self, batch_sizes: list[int], max_context: int) -> None:
        """Allocate the fixed index buffers the graphs of these decode batch sizes read."""
        raise NotImplementedError(f"{type(self).__name__} cannot run under CUDA graphs")

    def prepare_graph(self, batch: AttentionBatch, bs: int) -> None:
        """Like ``prepare`` for a pure-decode batch of at most ``bs`` requests, padded to ``bs``
        rows, into the fixed buffers of the graph of size ``bs``. ``batch.out_slots`` is the
        graph's fixed (bs,) buffer, padding rows already 0."""
        raise NotImplementedError(f"{type(self).__name__} cannot run under CUDA graphs")
