"""KV slot and request-row bookkeeping (metadata only: the tensors live in the worker).

Slots are token positions of the worker's KV pool (page size 1). Slot 0 is the worker's padding
slot and is never handed out, so a pool of ``pool_size`` usable slots spans ids 1..pool_size.
"""

from __future__ import annotations


class OutOfSlots(RuntimeError):
    """Asked for more KV slots than are free."""


class SlotAllocator:
    """Free list of KV slot ids."""

    def __init__(self, pool_size: int) -> None:
        assert pool_size > 0
        self.pool_size = pool_size
        self._free: list[int] = list(range(pool_size, 0, -1))  # pop() hands out low ids first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfSlots(f"need {n} KV slots, {len(self._free)} free")
        if n == 0:
            return []
        out = self._free[-n:]
        del self._free[-n:]
        out.reverse()
        return out

    def free(self, slots: list[int]) -> None:
        self._free.extend(slots)

    def check_integrity(self, in_use: int) -> None:
        """free + in use == pool size, and no slot is free twice."""
        assert len(set(self._free)) == len(self._free), "a KV slot is free twice"
        assert len(self._free) + in_use == self.pool_size, (
            f"KV leak: free {len(self._free)} + in use {in_use} != pool {self.pool_size}")


class RowAllocator:
    """Rows of the worker's ``req_to_token`` table, one per running request."""

    def __init__(self, rows: int) -> None:
        self.rows = rows
        self._free = list(range(rows - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self) -> int:
        return self._free.pop()

    def free(self, row: int) -> None:
        self._free.append(row)
