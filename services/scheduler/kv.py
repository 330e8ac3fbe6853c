"""KV manager: the slot allocator, the prefix cache and the request rows, behind the few operations
the scheduler needs. Metadata only.

A running request's KV slots (``req.slots``, one per computed position) are either cached in the
tree (it holds a lock on the deepest node of its cached path: ``req.lock_node``) or owned by the
request (``req.owned``). Invariant (``check_integrity``): free + cached (evictable + locked) +
owned by running requests == pool, in pages. With ``--disable-radix-cache`` the cache is the null
``NoPrefixCache``: the same operations, nothing ever cached. With a host tier (``hicache.py``) the
cache is a ``TieredRadixCache`` and ``hicache`` decides when a waiting request is ``ready``: not
while its prefix is being copied back into the pool.
"""

from __future__ import annotations

from typing import Protocol

from services.scheduler.cache import CacheHandle, NoPrefixCache, PrefixCache, RadixCache
from services.scheduler.counters import Counters
from services.scheduler.memory import OutOfSlots, RowAllocator, SlotAllocator
from services.scheduler.request import Req


class Tiers(Protocol):
    """What the KV manager asks of the hierarchical cache (``hicache.HiCache``)."""

    def ready(self, r: Req) -> bool: ...

    def admitted(self, r: Req) -> None: ...


class KVManager:
    def __init__(self, pool_size: int, max_rows: int, page_size: int = 1, enable_cache: bool = True,
                 counters: Counters | None = None) -> None:
        self.slots = SlotAllocator(pool_size, page_size)
        self.rows = RowAllocator(max_rows)
        self.cache: PrefixCache = (RadixCache if enable_cache else NoPrefixCache)(self.slots.free, page_size)
        self.caching = enable_cache
        self.counters = counters if counters is not None else Counters()
        self.released_rows: list[int] = []  # rows freed since the last batch (a diff for the worker)
        self.hicache: Tiers | None = None  # the host / disk tiers' controller, when the worker has them

    @property
    def page_size(self) -> int:
        return self.slots.page_size

    @property
    def pool_size(self) -> int:
        return self.slots.pool_size

    @property
    def evictable(self) -> int:
        return self.cache.evictable_size

    def available(self) -> int:
        """Tokens that can be allocated now, evicting unlocked cache entries if needed."""
        return self.slots.num_free + self.cache.evictable_size

    def peek_prefix(self, r: Req) -> int:
        """Cached prefix length of a waiting request (no side effects)."""
        return self.cache.peek(r.ns, r.prefix_key()).length

    def ready(self, r: Req) -> bool:
        """False while ``r``'s cached prefix is being brought back from the host or disk tier."""
        return self.hicache is None or self.hicache.ready(r)

    def admit(self, r: Req) -> None:
        """Give ``r`` a row and its cached prefix (locked)."""
        r.row = self.rows.alloc()
        m = self.cache.match(r.ns, r.prefix_key())
        self.cache.lock(m.handle)
        r.lock_node, r.slots = m.handle, m.slots
        r.cached_tokens = max(r.cached_tokens, len(r.slots))
        if self.hicache is not None:
            self.hicache.admitted(r)

    def extend(self, r: Req, n: int) -> list[int]:
        """Allocate ``n`` more slots for ``r``, evicting cached entries if needed."""
        last = r.slots[-1] if r.slots else None
        need = self.slots.tokens_needed(last, n)
        if need > self.slots.num_free:
            self.counters.evicted_tokens += self.cache.evict(need - self.slots.num_free)
        if need > self.slots.num_free:
            raise OutOfSlots(f"need {need} KV slots, {self.slots.num_free} free")
        new = self.slots.alloc(last, n)
        r.slots.extend(new)
        r.owned.update(new)
        return new

    def extend_each(self, reqs: list[Req]) -> list[int] | None:
        """One more slot for each of ``reqs`` (decodes), when that needs no eviction and pages hold one
        token; else None (``extend`` them one by one)."""
        new = self.slots.alloc_singles(len(reqs))
        if new is not None:
            for r, s in zip(reqs, new):
                r.slots.append(s)
                r.owned.add(s)
        return new

    def cache_prefix(self, r: Req) -> None:
        """Insert what ``r`` has computed so far, so others can share it (chunked prefill); ``r``
        then holds the lock on the node that ends there."""
        handle = self._insert(r)
        self.cache.lock(handle)
        if r.lock_node is not None:
            self.cache.unlock(r.lock_node)
        r.lock_node = handle

    def release(self, r: Req, keep: bool = True) -> None:
        """``r`` leaves the running set (finished, aborted or retracted): its computed KV goes into
        the cache (unless ``keep`` is false: the KV may be bad), what the cache did not take is
        freed, its row is released."""
        if r.slots and keep:
            self._insert(r)
        if r.lock_node is not None:
            self.cache.unlock(r.lock_node)
        self.slots.free(r.owned)
        r.owned, r.slots, r.lock_node = set(), [], None
        self.rows.free(r.row)
        self.released_rows.append(r.row)
        r.row = -1

    def _insert(self, r: Req):
        """Put ``r``'s computed KV (known tokens only: a step in flight may be computing one more)
        into the tree; the slots the tree took stop being ``r``'s. → the handle of what it holds."""
        key = r.tokens(0, min(len(r.slots), r.known_len))
        res = self.cache.insert(r.ns, key, r.slots[: len(key)])
        r.owned.difference_update(r.slots[res.cached:res.stored])
        return res.handle

    def pin(self, ns: str, tokens: list[int]) -> tuple[CacheHandle, int]:
        """Hold a lock on the cached prefix of ``tokens`` (sessions, pinned prefixes): exempt from
        eviction until ``unpin``. → the handle to unpin and how many tokens it covers."""
        m = self.cache.match(ns, tokens)
        self.cache.lock(m.handle)
        return m.handle, len(m.slots)

    def unpin(self, handle: CacheHandle) -> None:
        """Drop a lock ``pin`` took: the prefix is evictable again (unless something else holds it)."""
        self.cache.unlock(handle)

    def take_released_rows(self) -> list[int]:
        rows, self.released_rows = self.released_rows, []
        return rows

    def check_integrity(self, running: list[Req]) -> None:
        owned = sum(self.slots.pages_of(r.owned) for r in running)
        self.cache.check_integrity()
        cached = (self.cache.evictable_size + self.cache.locked_size) // self.page_size
        self.slots.check_integrity(owned + cached)


__all__ = ["KVManager", "OutOfSlots"]
