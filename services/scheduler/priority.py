"""Priority scheduling (``--enable-priority-scheduling``): a request's ``priority`` (an integer,
higher = more urgent) decides three things.

- **Order** (``PriorityPolicy``): the waiting queue is ordered by priority level first, highest
  first, and by the configured policy (fcfs, lpm, dfs-weight, lof) within a level. A request that has
  waited ``--priority-aging-seconds`` is *aged*: from then on it goes ahead of every level (oldest
  first) and, once running, is never preempted — nothing starves longer than that.
- **Preemption** (``Preemptor``, before each step is built): when the first waiting request in that
  order cannot start — no free running slot, or not enough KV headroom — running requests whose
  priority is at least ``--priority-preemption-threshold`` below its own are retracted, lowest
  priority and least progress first, until it can. A preempted request is an ordinary retraction:
  it keeps its output, its KV goes into the prefix cache, and it resumes from the queue later with
  the same greedy output. Nothing is preempted unless that makes room.
- **Shedding** (``shed_victims``): a full queue (``--max-queued-requests``) makes room for a new
  request by dropping its lowest-priority waiting requests (the newest of a level first; only
  requests below the new one's priority that never started), which end with RESOURCE_EXHAUSTED.

Without the flag every request has priority 0: the same code orders, preempts and sheds nothing.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from services.scheduler.kv import KVManager
from services.scheduler.policy import Policy
from services.scheduler.request import Req, Status

if TYPE_CHECKING:
    from services.scheduler.batcher import Batcher
    from services.scheduler.requests import RequestTable

AGED = float("inf")  # the level of aged requests: above every priority


class PriorityPolicy(Policy):
    """Priority levels first (highest first; aged requests above all, oldest first), ``inner``
    within a level."""

    def __init__(self, inner: Policy, aging_s: float = 0.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.inner, self.aging_s, self.clock = inner, aging_s, clock

    def order(self, waiting: Iterable[Req], kv: KVManager) -> list[Req]:
        reqs = list(waiting)
        levels: dict[float, list[Req]] = {}
        oldest = self.clock() - self.aging_s if self.aging_s > 0 else None
        for r in reqs:
            if oldest is not None and not r.aged and r.queued_at <= oldest:
                r.aged = True  # (for good: it resumes first and is not preempted)
            levels.setdefault(AGED if r.aged else r.priority, []).append(r)
        if len(levels) == 1 and AGED not in levels:
            return self.inner.order(reqs, kv)
        out: list[Req] = []
        for level in sorted(levels, reverse=True):
            group = levels[level]
            out += sorted(group, key=lambda r: r.arrival) if level == AGED else self.inner.order(group, kv)
        return out


class Preemptor:
    """Makes room for the waiting requests that outrank running ones (see the module doc)."""

    def __init__(self, policy: Policy, threshold: int) -> None:
        assert threshold >= 1
        self.policy, self.threshold = policy, threshold

    def run(self, b: Batcher, running: list[Req], waiting: deque[Req]) -> int:
        """Before ``b`` builds a step: preempt what the waiting requests, in order, need. → how many
        were preempted."""
        kv, lim = b.kv, b.limits
        lowest = min(r.priority for r in running)
        if all(w.priority < lowest + self.threshold for w in waiting):
            return 0  # (the common case, O(n): nobody outranks anyone running)
        # this step's decode takes its slots before admission sees the headroom
        margin = sum(kv.slots.tokens_needed(r.slots[-1], 1) for r in running if r.to_compute == 1 and r.slots)
        slots = min(lim.max_running - len(running), kv.rows.num_free)
        headroom = kv.available() - b._reserved(running) - margin
        preempted = 0
        for w in self.policy.order(waiting, kv):
            if w.pending or w.status is not Status.WAITING:
                continue  # (a retracted request waiting for its token in flight: admission skips it too)
            cost = b.admission_cost(w, kv.peek_prefix(w))
            if slots >= 1 and cost <= headroom:
                slots, headroom = slots - 1, headroom - cost  # it starts without preempting anyone
                continue
            victims = sorted((r for r in running if not r.aged and r.priority <= w.priority - self.threshold),
                             key=lambda r: (r.priority, len(r.output), -len(r.prompt)))
            # what preempting them all would free (their slots, their reservation): enough?
            if slots + len(victims) < 1 or headroom + sum(v.num_computed + b.reserved_by(v) for v in victims) < cost:
                break  # it cannot start even so; admission keeps the order, so nothing behind it starts
            while (slots < 1 or cost > headroom) and victims:
                v = victims.pop(0)
                b._retract(v, running, waiting, preempted_by=w)
                preempted += 1
                slots = min(lim.max_running - len(running), kv.rows.num_free)
                headroom = kv.available() - b._reserved(running) - margin
            if slots < 1 or cost > headroom:
                break
            slots, headroom = slots - 1, headroom - cost
        return preempted


def shed_victims(table: RequestTable, need: int, priority: int) -> list[str] | None:
    """Request ids to drop from the queue so that ``need`` more branches fit, all of a lower
    priority than ``priority`` and never started (every branch waiting, no output): the lowest
    priority first, the newest of a level first. None when they would not make enough room."""
    candidates: dict[str, Req] = {}
    queued = {id(r) for r in table.waiting}
    for r in table.waiting:
        if r.priority < priority and not r.output and not r.retractions:
            candidates.setdefault(r.rid, r)
    groups = []
    for rid, r in candidates.items():
        branches = table.groups.get(rid, ())
        if all(b.status is Status.WAITING and not b.output and id(b) in queued for b in branches):
            groups.append((r.priority, -r.arrival, rid, len(branches)))
    groups.sort()
    out, freed = [], 0
    for _, _, rid, n in groups:
        if freed >= need:
            break
        out.append(rid)
        freed += n
    return out if freed >= need else None
