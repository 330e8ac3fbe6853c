"""The prefix cache interface. Metadata only: values are KV slot ids, never tensors.

Semantics every implementation keeps:

- ``match(ns, key)`` returns the longest cached prefix of ``key`` in namespace ``ns`` (a whole
  number of pages) and a node handle for it; it may split a node so the handle covers exactly
  that prefix. It never changes which slots are cached.
- ``insert(ns, key, slots)`` caches ``key`` → ``slots`` (truncated to whole pages) and returns how
  many leading tokens were cached already. The cache takes ownership of the slots it stored; the
  caller still owns — and must free — its slots for the already-cached part (duplicates) and for
  the tail that was not stored.
- ``lock(node)`` / ``unlock(node)`` add/remove a reference on every node from ``node`` to the
  root. Locked nodes are never evicted.
- ``evict(n)`` frees at least ``n`` tokens' slots if it can, least recently used unlocked leaves
  first, handing them back to the slot allocator; returns how many it freed.
- Sizes: ``evictable_size`` (cached, unlocked) + ``locked_size`` (cached, locked) = cached tokens.
  ``check_integrity()`` verifies the structure and its counters.
- Namespaces never share entries (per-tenant ``cache_salt``, future LoRA adapters).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, NamedTuple


class MatchResult(NamedTuple):
    slots: list[int]  # KV slots of the matched prefix, one per token
    node: Any  # handle for lock/unlock; covers exactly the matched prefix


class PrefixCache(ABC):
    page_size: int

    @abstractmethod
    def match(self, ns: str, key: Sequence[int]) -> MatchResult: ...

    @abstractmethod
    def peek(self, ns: str, key: Sequence[int]) -> tuple[int, Any]:
        """Length of the cached prefix and the deepest node it reaches (possibly one whose edge it
        only partly matches), without changing the tree."""

    @abstractmethod
    def insert(self, ns: str, key: Sequence[int], slots: Sequence[int]) -> int: ...

    @abstractmethod
    def lock(self, node: Any) -> None: ...

    @abstractmethod
    def unlock(self, node: Any) -> None: ...

    @abstractmethod
    def evict(self, num_tokens: int) -> int: ...

    @property
    @abstractmethod
    def evictable_size(self) -> int: ...

    @property
    @abstractmethod
    def locked_size(self) -> int: ...

    @abstractmethod
    def check_integrity(self) -> None: ...
