"""A set of token sequences that answers "how many leading tokens of this key are a prefix of one
of them": the batcher's in-batch dedup (prompts being computed in this step and the one in
flight). A compressed trie per namespace, rebuilt every step; no values, locks or LRU."""

from __future__ import annotations

from collections.abc import Sequence

from services.scheduler.cache.radix import common_len


class _Node:
    __slots__ = ("edge", "kids")

    def __init__(self, edge: list[int]) -> None:
        self.edge = edge
        self.kids: dict[int, _Node] = {}


class PrefixSet:
    def __init__(self) -> None:
        self._roots: dict[str, _Node] = {}

    def add(self, ns: str, key: Sequence[int]) -> None:
        key = key if isinstance(key, list) else list(key)
        node = self._roots.get(ns)
        if node is None:
            node = self._roots[ns] = _Node([])
        pos = 0
        while pos < len(key):
            child = node.kids.get(key[pos])
            if child is None:
                node.kids[key[pos]] = _Node(key[pos:])
                return
            n = common_len(child.edge, key, pos)
            if n < len(child.edge):  # split: the common part becomes the upper node
                upper = _Node(child.edge[:n])
                child.edge = child.edge[n:]
                upper.kids[child.edge[0]] = child
                node.kids[key[pos]] = child = upper
            pos += n
            node = child

    def longest_prefix(self, ns: str, key: Sequence[int]) -> int:
        """Leading tokens of ``key`` that some added sequence starts with."""
        key = key if isinstance(key, list) else list(key)
        node = self._roots.get(ns)
        pos = 0
        while node is not None and pos < len(key):
            child = node.kids.get(key[pos])
            if child is None:
                break
            n = common_len(child.edge, key, pos)
            pos += n
            if n < len(child.edge):
                break
            node = child
        return pos
