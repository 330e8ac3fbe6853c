"""Scheduling policies: the order in which waiting requests are considered for admission.

- ``fcfs``: arrival order.
- ``lpm``: longest cached prefix first (most reuse now, before the prefix is evicted).
- ``dfs-weight``: walk the prefix tree depth-first, heavier subtrees (more waiting requests)
  first, so requests sharing a prefix run together.
- ``lof``: longest output first (the most new tokens left to generate; ties keep arrival order).
  For offline batches: the requests that will run longest start first, so the run does not end
  in a tail of a few late, long requests at a small batch (longest-processing-time-first for the
  makespan); online, a short request waits behind long ones that queued with it.
Cache-aware policies fall back to FCFS when the queue is long (matching every request each step
would cost more than it saves). They see the tree only through the ``PrefixCache`` interface.
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
        if len(reqs) > LONG_QUEUE:
            return reqs
        hits = [kv.peek_prefix(r) for r in reqs]
        return [reqs[i] for i in sorted(range(len(reqs)), key=lambda i: -hits[i])]  # stable: ties keep arrival order


class DFSWeight(Policy):
    def order(self, waiting, kv):
        reqs = list(waiting)
        if len(reqs) > LONG_QUEUE:
            return reqs
        handles = [kv.cache.peek(r.ns, r.prefix_key()).handle for r in reqs]
        return [reqs[i] for i in kv.cache.subtree_order(handles)]


class LongestOutputFirst(Policy):
    def order(self, waiting, kv):
        return sorted(waiting, key=lambda r: -r.remaining_new_tokens)  # (stable: ties keep arrival order)


POLICIES: dict[str, type[Policy]] = {"fcfs": FCFS, "lpm": LongestPrefixMatch, "dfs-weight": DFSWeight,
                                     "lof": LongestOutputFirst}
