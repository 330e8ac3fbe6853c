"""Builds one ``ForwardBatch`` per step.

1. Decode: every running request with one token left to compute gets one slot. When the pool
   (free + evictable cache) cannot supply them, the cheapest requests are retracted: their KV
   goes into the prefix cache, they return to the head of the queue and resume later.
2. Prefill: requests already mid-prefill continue (chunked prefill), then waiting requests are
   admitted in policy order under the step's token budget (``max_prefill_tokens``) and the
   per-request chunk size (``chunked_prefill_size``). Admission is optimistic: it reserves the
   whole prompt plus ``new_token_ratio`` × the expected decode length of every running request;
   the ratio decays while decoding goes well and resets when a retraction happens. With priority
   scheduling the highest priority present goes first (its chunks, then admission in priority
   order, then the chunks of the lower levels), and the lower levels share at most
   ``low_priority_prefill`` prompt tokens a step: an urgent request's steps stay short (also for
   ``low_priority_window`` seconds after the last one left, for the next one's sake). With
   ``step_target_ms`` a step in which requests decode carries only the prompt tokens its fitted cost
   model (``step_model.py``) lets within that time: long prompts spread over steps, ITL stays level.
3. In-batch dedup: a waiting request whose uncached prefix is being computed by another request
   right now waits a step, then finds it in the cache (this is how n > 1 branches share a prompt).

With priority scheduling (``priority.py``) the policy orders the queue by priority first, and a
``Preemptor`` runs before each build: it retracts lower-priority running requests (as step 1
does) so that a waiting request that could not otherwise start does.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import msgspec

from shared.logging import get_logger, stage
from shared.messages.common import i32
from shared.messages.to_worker import ForwardBatch, NewReq
from services.scheduler.cache import PrefixSet
from services.scheduler.cascade import CascadePolicy, Groups, plan_groups
from services.scheduler.counters import Counters
from services.scheduler.kv import KVManager
from services.scheduler.plan import Plan
from services.scheduler.policy import Policy
from services.scheduler.request import Req, Status, worker_extras
from services.scheduler.step_model import StepModel

log = get_logger("scheduler")
DEDUP_MIN_TOKENS = 32
DECODE_CLIP = 4096  # expected-decode estimate is capped per request
INIT_RATIO, MIN_RATIO, RATIO_DECAY = 0.7, 0.1, 0.001
URGENT_RUN = 2  # urgent steps in a row at most (priority scheduling: ``Limits.urgent_steps``)


@dataclass
class Scheduled:
    """A batch in flight: the requests in batch order and which of them sample."""

    step_id: int
    reqs: list[Req]
    extend: list[int]
    emits: list[bool]  # the step emits this request's next token (its last token is computed now)
    num_tokens: int
    prefill_tokens: int
    msg: ForwardBatch
    queue_s: list[float] = field(default_factory=list)  # queue times of requests scheduled for the first time
    cascade_saved: int = 0  # KV tokens the shared-prefix groups save (0: no groups)


@dataclass(frozen=True)
class Limits:
    max_running: int
    max_prefill_tokens: int
    chunked_prefill_size: int
    # priority scheduling: prompt tokens a step gives requests below the highest priority present (None:
    # priority scheduling off — one level, nothing capped)
    low_priority_prefill: int | None = None
    # ... and for this many seconds after a higher level was last present: the cap stays on between one
    # interactive request and the next, so that the next does not find a full-size chunk in flight (0: only
    # while one is present)
    low_priority_window: float = 0.0
    # priority scheduling: the step that admits a top-level request leaves the lower levels out (at most
    # URGENT_RUN steps in a row), so its first token does not wait for a full batch of theirs
    urgent_steps: bool = False
    # the worker's largest CUDA-graph decode batch: jump-forward chunks become one-token rows when the
    # step then fits it (``Plan.split_output_chunks``; 0: never)
    graph_bs: int = 0
    # --step-time-target-ms: a step with decodes carries the prompt tokens that keep it within this many ms
    # by the fitted ``StepModel`` (0: off)
    step_target_ms: float = 0.0


class _Budget:
    """A step's prompt tokens: ``total`` for all, at most ``low`` of them for requests below ``top``."""

    def __init__(self, total: int, top: float, low: int | None) -> None:
        self.total, self.top, self.low = total, top, low

    def left(self, r: Req) -> int:
        if self.low is not None and _level(r) < self.top:
            return min(self.total, self.low)
        return self.total

    def take(self, r: Req, n: int) -> None:
        self.total -= n
        if self.low is not None and _level(r) < self.top:
            self.low -= n


def _level(r: Req) -> float:
    return float("inf") if r.aged else r.priority


class Batcher:
    def __init__(self, kv: KVManager, policy: Policy, limits: Limits, cascade: CascadePolicy | None = None,
                 counters: Counters | None = None, preemptor: Any = None, clock=time.monotonic) -> None:
        self.kv, self.policy, self.limits, self.clock = kv, policy, limits, clock
        self.preemptor = preemptor  # priority.Preemptor (priority scheduling with preemption), or None
        self.cascade = cascade if kv.caching else None  # (no cache: nothing is shared)
        self.counters = counters if counters is not None else kv.counters  # step ids, retractions, cascade totals
        self.new_token_ratio = INIT_RATIO
        self.step_model = StepModel()  # fitted to answered steps while ``limits.step_target_ms`` is set
        self.last_prompt_budget = limits.max_prefill_tokens  # (the last step with decodes: its prompt tokens' cap)
        self._prefilled: list[Req] = []  # requests with prompt tokens in the last batch built
        self._urgent_run = 0  # urgent steps in a row just before (``Limits.urgent_steps``)
        self._groups_memo: tuple[Any, Groups | None, Any] = (None, None, None)  # (batch key, its groups, refs)
        self._levels_seen: dict[float, float] = {}  # priority level -> when last present (``low_priority_window``)

    def build(self, running: list[Req], waiting: deque[Req]) -> Scheduled | None:
        plan = Plan()
        if self.preemptor is not None and waiting and running:
            self.preemptor.run(self, running, waiting)
        # (overlap: a request whose last token is still being sampled has nothing left to decode when
        # that token will be its last; it finishes when the token arrives)
        decoding = [r for r in running if r.to_compute == 1 and (r.remaining_new_tokens > 0 or not r.in_flight)]
        self._make_room_for_decode(decoding, running, waiting)
        budget = self._budget(running, waiting, decoding)
        # an urgent step? the lower levels' decodes wait until the top level's admissions are known
        urgent, held = self._urgent_possible(decoding, waiting, budget), []
        now = []
        for r in decoding:
            if r.status is not Status.RUNNING:
                continue
            if urgent and _level(r) < budget.top:
                held.append(r)
            else:
                now.append(r)
        plan.add_decodes(now, self.kv)
        self.new_token_ratio = max(MIN_RATIO, self.new_token_ratio - RATIO_DECAY)
        scratch = PrefixSet()  # prompts being computed this step (in-batch dedup)
        for r in self._prefilled:  # (overlap: computed by the step in flight, not in the cache yet)
            if r.status is Status.RUNNING:
                scratch.add(r.ns, r.tokens(0, min(r.num_computed, r.known_len)))
        chunks = [r for r in running if r.to_compute > 1]
        for r in chunks:
            if r.num_computed < len(r.prompt):  # (a jump-forward chunk is its own: nobody waits for it)
                scratch.add(r.ns, r.prefix_key())
        # the highest priority present first (its chunks, then its admissions), then the lower levels
        # under their cap, the same way (one level — priority scheduling off — chunks, then admission)
        self._chunks([r for r in chunks if _level(r) >= budget.top], budget, plan)
        order = self.policy.order(waiting, self.kv) if waiting and budget.total > 0 else []  # (once a step)
        new_reqs, blocked = self._admit(order, running, waiting, scratch, budget, plan, top=True)
        if held and new_reqs:  # the admitted request's step: the lower levels wait for the next one
            self._urgent_run += 1
            self.counters.urgent_steps += 1
            return self._emit(plan, new_reqs)
        self._urgent_run = 0
        plan.add_decodes(held, self.kv)  # (no top-level request could start: the lower levels decode as usual)
        if budget.top > float("-inf"):  # (levels: priority scheduling)
            self._chunks([r for r in chunks if _level(r) < budget.top], budget, plan)
            if not blocked:  # (a top-level request that does not fit yet is not overtaken by lower ones)
                new_reqs += self._admit(order, running, waiting, scratch, budget, plan, top=False)[0]
        if not plan.reqs:
            return None
        return self._emit(plan, new_reqs)

    def _groups(self, plan: Plan) -> Groups | None:
        """``plan_groups`` of the batch — the last one's again when the batch is the same requests
        holding the same cache nodes, all decoding (a decode-only run of steps: W3's 254 of them). A
        node's slots never change while it is locked, so groups found once stay right; a deeper node
        that a later insert splits off could only make them larger."""
        decode = max(plan.extend) == 1
        key = [(id(r), id(r.lock_node)) for r in plan.reqs] if decode else None
        if key is not None and self._groups_memo[0] == key:
            return self._groups_memo[1]
        groups = plan_groups(plan.reqs, plan.prefix, self.cascade, self.kv.cache, decode)
        # (the memo holds the requests and nodes themselves: their ids cannot be reused meanwhile)
        self._groups_memo = (key, groups, [(r, r.lock_node) for r in plan.reqs] if decode else None)
        return groups

    def _urgent_possible(self, decoding: list[Req], waiting: deque[Req], budget: _Budget) -> bool:
        """A top-level request waits while lower-level ones decode (and fewer than ``URGENT_RUN`` urgent
        steps came just before: a second arrival within a step of the first gets its own step too —
        not one with the whole background's chunk and decodes — but the background never waits more
        than ``URGENT_RUN`` steps)."""
        return (self.limits.urgent_steps and self._urgent_run < URGENT_RUN and budget.top > float("-inf")
                and any(_level(r) >= budget.top for r in waiting) and any(_level(r) < budget.top for r in decoding))

    def _budget(self, running: list[Req], waiting: deque[Req], decoding: list[Req]) -> _Budget:
        low, total = self.limits.low_priority_prefill, self.limits.max_prefill_tokens
        decodes = sum(1 for r in decoding if r.status is Status.RUNNING) if self.limits.step_target_ms else 0
        if decodes:  # (--step-time-target-ms, and someone's next token waits for this step)
            backlog = sum(r.to_compute for r in running if r.to_compute > 1) + sum(r.to_compute for r in waiting)
            total = self.last_prompt_budget = self.step_model.prompt_budget(self.limits.step_target_ms, decodes,
                                                                            total, backlog)
        if low is None or not (running or waiting):
            return _Budget(total, float("-inf"), None)
        top = max(max((_level(r) for r in running), default=float("-inf")),
                  max((_level(r) for r in waiting), default=float("-inf")))
        if self.limits.low_priority_window > 0:  # the highest level present lately
            now, seen = self.clock(), self._levels_seen
            if top != float("inf"):  # (aged requests are above every level, not a level to protect)
                seen[top] = now
            for level in [lv for lv, t in seen.items() if now - t > self.limits.low_priority_window]:
                del seen[level]
            top = max(top, max(seen, default=top))
        return _Budget(total, top, low or None)  # (0: levels ordered, nothing capped)

    def _chunks(self, reqs: list[Req], budget: _Budget, plan: Plan) -> None:
        """The next chunk of each running request still computing its prompt (or a jump-forward)."""
        for r in reqs:
            n = min(r.to_compute, self.limits.chunked_prefill_size, budget.left(r))
            if n > 0:
                budget.take(r, plan.add(r, self.kv, n))

    # ---- decode memory ---------------------------------------------------------------------
    def _make_room_for_decode(self, decoding: list[Req], running: list[Req], waiting: deque[Req]) -> None:
        kv = self.kv

        def need() -> int:
            return sum(kv.slots.tokens_needed(r.slots[-1], 1) for r in decoding if r.status is Status.RUNNING)

        if need() <= kv.available():
            return
        # the least progress first (lowest priority first; aged requests last)
        victims = sorted(decoding, key=lambda r: (r.aged, r.priority, len(r.output), -len(r.prompt)))
        while need() > kv.available() and victims:
            r = victims.pop(0)
            self._retract(r, running, waiting)

    def _retract(self, r: Req, running: list[Req], waiting: deque[Req], preempted_by: Req | None = None) -> None:
        """``r`` leaves the batch keeping its output: its KV goes into the cache, it waits at the head
        of the queue and resumes (recomputing what the cache lost) with the same greedy output."""
        self.kv.release(r)
        running.remove(r)
        r.status, r.retractions, r.queued_at = Status.WAITING, r.retractions + 1, time.monotonic()
        waiting.appendleft(r)
        if preempted_by is None:
            self.counters.retractions += 1
            self.new_token_ratio = INIT_RATIO
            stage("retracted", r.rid, trace_id=r.trace_id, index=r.index, output_tokens=len(r.output),
                  kv_available=self.kv.available())
        else:
            self.counters.preemptions += 1
            stage("preempted", r.rid, trace_id=r.trace_id, index=r.index, output_tokens=len(r.output),
                  priority=r.priority, by=preempted_by.rid, by_priority=preempted_by.priority)

    # ---- admission -------------------------------------------------------------------------
    def _reserved(self, running: list[Req]) -> float:
        """Slots running requests are expected to take: the rest of their prompts and part of
        their decode."""
        prompt = sum(r.to_compute - 1 for r in running if r.to_compute > 1)
        return prompt + sum(min(max(r.remaining_new_tokens, 0), DECODE_CLIP) for r in running) * self.new_token_ratio

    def reserved_by(self, r: Req) -> float:
        """``r``'s share of ``_reserved``."""
        return max(r.to_compute - 1, 0) + min(max(r.remaining_new_tokens, 0), DECODE_CLIP) * self.new_token_ratio

    def admission_cost(self, r: Req, hit: int) -> float:
        """Slots a waiting request with ``hit`` cached tokens is expected to take once admitted."""
        return r.seq_len - hit + min(r.remaining_new_tokens, DECODE_CLIP) * self.new_token_ratio

    def _admit(self, order: list[Req], running: list[Req], waiting: deque[Req], scratch: PrefixSet,
               budget: _Budget, plan: Plan, top: bool) -> tuple[list[NewReq], bool]:
        """Admit waiting requests in ``order`` (the policy's, taken once a step): those of the highest
        level present (``top``), or those below it → (their NewReqs, whether one that could run
        stopped admission: no room). Requests the first pass admitted are of the top level: the
        second pass skips them."""
        lim, kv = self.limits, self.kv
        new_reqs: list[NewReq] = []
        if not waiting or budget.total <= 0:
            return new_reqs, False
        headroom = kv.available() - self._reserved(running)
        for r in order:
            if (_level(r) >= budget.top) != top:
                if top:
                    break  # (priority order: the rest are below the top level)
                continue
            if budget.left(r) <= 0 or len(running) >= lim.max_running or kv.rows.num_free == 0:
                return new_reqs, True
            if r.pending:
                continue  # retracted while its last token was in flight: resumes once that arrives
            if not kv.ready(r):
                continue  # its cached prefix is coming back from the host or disk tier (hicache.py)
            hit = kv.peek_prefix(r)
            key = r.prefix_key()
            shared = scratch.longest_prefix(r.ns, key)
            if shared - hit > 0 and shared - hit >= min(DEDUP_MIN_TOKENS, len(key) - hit):
                continue  # its prefix is being computed right now: take it from the cache next step
            cost = self.admission_cost(r, hit)
            if cost > headroom:
                return new_reqs, True  # keep the order: later requests do not overtake a head that does not fit
            before = kv.available()
            waiting.remove(r)
            kv.admit(r)
            headroom -= cost + (before - kv.available())  # locking its prefix pins evictable slots
            r.status = Status.RUNNING
            running.append(r)
            scratch.add(r.ns, key)
            new_reqs.append(NewReq(rid=r.rid, row=r.row, params=r.params, prefix_slots=i32(r.slots),
                                   output_ids=i32(r.output) if r.output and (r.params.penalized or r.params.processed)
                                   else b"", traceparent=r.traceparent, **worker_extras(r)))
            queue_ms = r.wait_ms()
            if not r.retractions:
                plan.queue_s.append(queue_ms / 1e3)
            stage("scheduled", r.rid, trace_id=r.trace_id, index=r.index, queue_ms=round(queue_ms, 3),
                  prompt_tokens=len(r.prompt), cached_tokens=len(r.slots), retractions=r.retractions)
            budget.take(r, plan.add(r, kv, min(r.to_compute, lim.chunked_prefill_size, budget.left(r))))
        return new_reqs, False

    def _emit(self, plan: Plan, new_reqs: list[NewReq]) -> Scheduled:
        c = self.counters
        if self.limits.graph_bs:
            plan.split_output_chunks(self.limits.graph_bs)
        c.steps += 1  # (steps and their tokens are counted when sent: GetLoad agrees with the worker's
        c.prefill_computed += plan.prefill_tokens  # counters as soon as it has answered them)
        c.decode += len(plan.ids) - plan.prefill_tokens
        self._prefilled = plan.prefilled
        groups = self._groups(plan) if self.cascade else None
        if groups is not None:  # the groups' members first, group by group: the worker's shared level then
            last = len(groups.lens)  # reads their queries in place (no gather, no scatter)
            order = sorted(range(len(groups.group)), key=lambda i: groups.group[i] if groups.group[i] >= 0 else last)
            plan.reorder(order)
            groups = Groups([groups.group[i] for i in order], groups.lens, groups.saved)
        msg = ForwardBatch(
            step_id=c.steps, new_reqs=new_reqs, released_rows=self.kv.take_released_rows(),
            rows=i32([r.row for r in plan.reqs]), prefix_lens=i32(plan.prefix), extend_lens=i32(plan.extend),
            emits=i32(plan.emits), input_ids=i32(plan.ids), out_slots=i32(plan.slots))
        if groups is not None:
            c.cascade_steps += 1
            c.cascade_saved += groups.saved
            msg = msgspec.structs.replace(msg, cascade_group=i32(groups.group), cascade_lens=i32(groups.lens))
        return Scheduled(c.steps, plan.reqs, plan.extend, plan.emits, len(plan.ids), plan.prefill_tokens, msg,
                         plan.queue_s, groups.saved if groups else 0)
