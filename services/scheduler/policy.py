"""Scheduling policies: the order in which waiting requests are considered for admission.

- ``fcfs``: arrival order.
- ``lpm``: longest cached prefix first (most reuse now, before the prefix is evicted).
- ``dfs-weight``: walk the prefix tree depth-first, heavier subtrees (more waiting requests)
  first, so requests sharing a prefix run together.
Cache-aware policies fall back to FCFS when the queue is long (matching every request each step
would cost more than it saves).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable

from services.scheduler.kv import KVManager
from services.scheduler.request import Req

LONG_QUEUE = 128


class Policy(ABC):
    @abstractmethod
    def order(self, waiting: Iterable[Req], kv: KVManager) -> list[Req]: ...


class FCFS(Policy):
    def order(self, waiting, kv):
        return list(waiting)


class LongestPrefixMatch(Policy):
    def order(self, waiting, kv):
        reqs = list(waiting)
        if len(reqs) > LONG_QUEUE or kv.cache is None:
            return reqs
        hits = {id(r): kv.peek_prefix(r) for r in reqs}
        return sorted(reqs, key=lambda r: -hits[id(r)])  # stable: ties keep arrival order


class DFSWeight(Policy):
    def order(self, waiting, kv):
        reqs = list(waiting)
        if len(reqs) > LONG_QUEUE or kv.cache is None:
            return reqs
        at: dict[int, list[Req]] = {}
        nodes: dict[int, object] = {}
        weight: dict[int, int] = {}
        roots: dict[int, object] = {}
        for r in reqs:
            _, node = kv.cache.peek(r.ns, r.prefix_key())
            node = node or _UNCACHED
            at.setdefault(id(node), []).append(r)
            n = node
            while n is not None:
                nodes[id(n)] = n
                weight[id(n)] = weight.get(id(n), 0) + 1
                if n.parent is None:
                    roots[id(n)] = n
                n = n.parent
        out: list[Req] = []
        stack = sorted(roots.values(), key=lambda n: weight[id(n)])
        while stack:
            n = stack.pop()
            out.extend(at.get(id(n), ()))
            kids = [c for c in n.children.values() if id(c) in weight]
            stack.extend(sorted(kids, key=lambda c: weight[id(c)]))  # heaviest popped first
        return out


class _Uncached:
    """Stands for the root of a namespace with nothing cached yet."""

    parent = None
    children: dict = {}


_UNCACHED = _Uncached()

POLICIES: dict[str, type[Policy]] = {"fcfs": FCFS, "lpm": LongestPrefixMatch, "dfs-weight": DFSWeight}
