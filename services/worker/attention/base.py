"""The attention backend interface and the per-step batch state it reads.

Paged KV layout (page size 1): per layer, ``k`` and ``v`` tensors of shape
(num_slots, num_kv_heads, head_dim). A request's KV lives at the slots listed in its row of the
``req_to_token`` table, in position order. Slot 0 is reserved as padding and never allocated.
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

    req_to_token: torch.Tensor  # (R, C) int32, device: slot of each position of each row
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
    """Writes the new tokens' K/V into the pool and computes attention for them."""

    @abstractmethod
    def prepare(self, batch: AttentionBatch) -> None:
        """Build per-step metadata (index buffers, kernel plans) before the layers run."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
        """q (T, Hq, D), k/v (T, Hkv, D) of the new tokens → output (T, Hq, D).

        Stores k/v at ``batch.out_slots`` of layer ``layer``, then attends each new token to its
        request's positions 0..its own (causal), prefix included.
        """
