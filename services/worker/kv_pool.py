"""The paged KV cache (page size 1): per layer, K and V slot tensors."""

from __future__ import annotations

import torch


class KVPool:
    """``k[l]``, ``v[l]``: (num_slots, num_kv_heads, head_dim) per layer ``l``.

    ``num_slots`` includes slot 0, the padding slot that is never allocated; the tensors start
    zeroed so that reading padding yields finite values.
    """

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        if num_slots < 2:
            raise ValueError(f"a KV pool needs at least 2 slots (slot 0 is padding), got {num_slots}")
        shape = (num_slots, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @property
    def num_slots(self) -> int:
        return self.k[0].shape[0]

    @property
    def dtype(self) -> torch.dtype:
        return self.k[0].dtype

    @property
    def device(self) -> torch.device:
        return self.k[0].device


def pool_slots_for_memory(bytes_budget: int, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """How many slots (padding slot included) a pool of these dimensions fits in ``bytes_budget``."""
    bytes_per_slot = 2 * num_layers * kv_heads * head_dim * dtype.itemsize  # K and V
    return bytes_budget // bytes_per_slot
