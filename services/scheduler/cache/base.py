"""The prefix cache interface. Metadata only: values are KV slot ids, never tensors.

Semantics every implementation keeps:

- ``match(ns, key)`` returns the longest cached prefix of ``key`` in namespace ``ns`` (a whole
  number of pages) and a handle for it; it may split a node so the handle covers exactly that
  prefix. It never changes which slots are cached. It refreshes the prefix's LRU age.
- ``peek(ns, key)`` returns the same length without changing anything (no split, no LRU update);
  its handle is the deepest node reached, possibly one whose edge the key only partly matches.
- ``insert(ns, key, slots)`` caches ``key`` → ``slots`` (truncated to whole pages). The result
  says which tokens the cache took: ``[cached, stored)``. The caller still owns — and must free —
  its slots for ``[0, cached)`` (duplicates of what was cached already) and for the unaligned
  tail ``[stored, len)``. Its handle covers exactly ``key[:stored]`` (lock it to keep it).
- ``lock(handle)`` / ``unlock(handle)`` add/remove a reference on every node from ``handle`` to
  the root. Locked nodes are never evicted. Locks are held by running requests (for a step or a
  request's life) and also for long: a session holds one on each of its turns, a pinned prefix
  (``PinPrefix``) on its prompt, until closed, unpinned or expired (``KVManager.pin``); a tier
  below the device must keep a locked node's KV where the worker reads it.
- ``evict(n)`` frees at least ``n`` tokens' slots if it can, least recently used unlocked leaves
  first, handing them back to the slot allocator; returns how many it freed.
- Sizes: ``evictable_size`` (cached, unlocked) + ``locked_size`` (cached, locked) = cached tokens.
  ``check_integrity()`` verifies the structure and its counters.
- Namespaces never share entries (per-tenant ``cache_salt``, future LoRA adapters).
- Walks for cache-aware scheduling stay behind the interface: ``path(handle)`` (the nodes from
  the root down to a handle, for shared-prefix groups) and ``subtree_order(handles)`` (a
  depth-first order of requests by their place in the tree, heavier subtrees first).
- ``listener`` (None: nobody listens, nothing is reported): told of every token range that enters
  (``stored``) or leaves (``removed``, children before parents) the cache, for KV-cache events
  (``services/scheduler/kv_events.py``); ``walk()`` lists what is cached, for a snapshot. With
  tiers below the device (``tiers.py``) a range is in the cache while any tier holds it.
- ``flush()`` drops every prefix no request holds (FlushCache), from every tier.

A handle is opaque except for ``depth`` (tokens from the root to its end) and ``last_slot`` (the
KV slot of its last token). Where a node's KV lives is the implementation's business: the tiered
cache (``tiers.py``) keeps nodes whose KV left the device in host memory or on disk, and ``match``
/ ``peek`` see only the device prefix (a waiting request gets the rest back through
``hicache.py`` before it is admitted).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple, Protocol


class CacheHandle(Protocol):
    """A node of the cache (or the root of a namespace): what lock/unlock and walks take."""

    @property
    def depth(self) -> int:
        """Tokens from the namespace's root to the end of this node (0 for a root)."""

    @property
    def last_slot(self) -> int:
        """The KV slot of the node's last token (-1 for a root)."""


class CacheListener(Protocol):
    """Told of what enters and leaves a cache: ``key[start:end]`` of namespace ``ns``, where
    ``key`` is the whole path from the namespace's root (``len(key) >= end``)."""

    def stored(self, ns: str, key: Sequence[int], start: int, end: int) -> None: ...

    def removed(self, ns: str, key: Sequence[int], start: int, end: int) -> None: ...


class MatchResult(NamedTuple):
    slots: list[int]  # KV slots of the matched prefix, one per token
    handle: CacheHandle  # covers exactly the matched prefix


class PeekResult(NamedTuple):
    length: int  # tokens of the key that are cached
    handle: CacheHandle | None  # the deepest node reached (None: nothing cached in the namespace)


class InsertResult(NamedTuple):
    cached: int  # leading tokens that were cached already (the caller keeps their duplicate slots)
    stored: int  # the cache now holds key[:stored]: it took the slots of [cached, stored)
    handle: CacheHandle  # covers exactly key[:stored]


class PrefixCache(ABC):
    page_size: int
    listener: CacheListener | None = None

    def walk(self) -> Iterator[tuple[str, int, list[int]]]:
        """Every node, depth-first, parents first: (namespace, tokens above it, its edge's tokens)."""
        return iter(())

    def flush(self) -> int:
        """Drop every cached prefix no request holds (with tiers below the device: from every tier);
        → the device tokens freed."""
        return self.evict(self.evictable_size)

    @abstractmethod
    def match(self, ns: str, key: Sequence[int]) -> MatchResult: ...

    @abstractmethod
    def peek(self, ns: str, key: Sequence[int]) -> PeekResult: ...

    @abstractmethod
    def insert(self, ns: str, key: Sequence[int], slots: Sequence[int]) -> InsertResult: ...

    @abstractmethod
    def lock(self, handle: CacheHandle) -> None: ...

    @abstractmethod
    def unlock(self, handle: CacheHandle) -> None: ...

    @abstractmethod
    def evict(self, num_tokens: int) -> int: ...

    @abstractmethod
    def path(self, handle: CacheHandle) -> list[CacheHandle]:
        """The nodes from the root (excluded) down to ``handle``, top first."""

    @abstractmethod
    def subtree_order(self, handles: Sequence[CacheHandle | None]) -> list[int]:
        """Indices of ``handles`` (one per waiting request; None: nothing cached) in depth-first
        order of the tree, the subtree with more of them first: requests sharing a prefix end up
        next to each other, the largest family first."""

    @property
    @abstractmethod
    def evictable_size(self) -> int: ...

    @property
    @abstractmethod
    def locked_size(self) -> int: ...

    @abstractmethod
    def check_integrity(self) -> None: ...


class _Root:
    """The one handle of ``NoPrefixCache``: an empty prefix."""

    depth = 0
    last_slot = -1


class NoPrefixCache(PrefixCache):
    """``--disable-radix-cache``: nothing is ever cached, every request computes its whole prompt."""

    ROOT = _Root()

    def __init__(self, free_slots: Callable[[list[int]], None] | None = None, page_size: int = 1) -> None:
        self.page_size = page_size

    def match(self, ns, key):
        return MatchResult([], self.ROOT)

    def peek(self, ns, key):
        return PeekResult(0, None)

    def insert(self, ns, key, slots):
        return InsertResult(0, 0, self.ROOT)

    def lock(self, handle):
        pass

    def unlock(self, handle):
        pass

    def evict(self, num_tokens):
        return 0

    def path(self, handle):
        return []

    def subtree_order(self, handles):
        return list(range(len(handles)))

    @property
    def evictable_size(self):
        return 0

    @property
    def locked_size(self):
        return 0

    def check_integrity(self):
        pass
