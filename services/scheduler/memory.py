"""KV slot and request-row bookkeeping (metadata only: the tensors live in the worker).

Slots index the worker's KV pool token by token (ids 0..pool_size; slot 0 is the worker's padding
slot). Slots are handed out in pages of ``page_size`` aligned slots: page p covers slots
[p·P, p·P + P), page 0 is reserved. A request fills the tail of its last page before taking a
new one; freeing is by page (callers free every slot they own in a page together).
"""

from __future__ import annotations


class OutOfSlots(RuntimeError):
    """Asked for more KV slots than are free."""


class SlotAllocator:
    def __init__(self, pool_size: int, page_size: int = 1) -> None:
        assert pool_size > 0 and page_size >= 1
        self.page_size = page_size
        self.num_pages = (pool_size + 1) // page_size - 1
        assert self.num_pages > 0, f"pool of {pool_size} tokens holds no page of {page_size}"
        self._free: list[int] = list(range(self.num_pages, 0, -1))  # pop() hands out low pages first

    @property
    def pool_size(self) -> int:
        """Usable tokens."""
        return self.num_pages * self.page_size

    @property
    def num_free(self) -> int:
        return len(self._free) * self.page_size

    def tokens_needed(self, last_slot: int | None, n: int) -> int:
        """Free tokens (whole pages) that ``alloc(last_slot, n)`` takes from the pool."""
        room = 0 if last_slot is None else (self.page_size - 1 - last_slot % self.page_size)
        pages = -(-max(0, n - room) // self.page_size)
        return pages * self.page_size

    def alloc(self, last_slot: int | None, n: int) -> list[int]:
        """``n`` slots continuing after ``last_slot`` (the request's latest slot, or None)."""
        P = self.page_size
        out: list[int] = []
        if last_slot is not None and P > 1:
            out = list(range(last_slot + 1, min(last_slot + 1 + n, (last_slot // P + 1) * P)))
        need = -(-(n - len(out)) // P)
        if need > len(self._free):
            raise OutOfSlots(f"need {need} KV pages, {len(self._free)} free")
        for _ in range(need):
            p = self._free.pop()
            out.extend(range(p * P, p * P + P))
        del out[n:]
        return out

    def alloc_singles(self, n: int) -> list[int] | None:
        """One slot for each of ``n`` requests (page size 1; None when fewer are free), as ``n``
        calls of ``alloc(_, 1)`` would hand them out."""
        free = self._free
        if self.page_size != 1 or n > len(free):
            return None
        out = free[len(free) - n:][::-1]
        del free[len(free) - n:]
        return out

    def free(self, slots) -> None:
        """Return ``slots`` (pushed highest first, so that ``alloc`` hands them out again in rising
        runs: the host tier copies one run of consecutive slots per DMA)."""
        if self.page_size == 1:
            self._free.extend(sorted(slots, reverse=True))
        else:
            self._free.extend(sorted({s // self.page_size for s in slots}, reverse=True))

    def pages_of(self, slots) -> int:
        return len(slots) if self.page_size == 1 else len({s // self.page_size for s in slots})

    def check_integrity(self, in_use_pages: int) -> None:
        """free + in use == pool, and no page is free twice."""
        assert len(set(self._free)) == len(self._free), "a KV page is free twice"
        assert len(self._free) + in_use_pages == self.num_pages, (
            f"KV leak: free {len(self._free)} + in use {in_use_pages} != pool {self.num_pages} pages")


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
