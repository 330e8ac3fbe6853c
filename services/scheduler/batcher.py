"""Builds one ``ForwardBatch`` per step: every decoding request gets one token, then prompt
chunks are added under the prefill token budget (chunked prefill: a long prompt spans steps).

Admission reserves each request's worst case (prompt + max_new_tokens) so decoding never runs
out of KV slots.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from shared.logging import stage
from shared.messages.common import i32
from shared.messages.to_worker import ForwardBatch, NewReq
from services.scheduler.memory import RowAllocator, SlotAllocator
from services.scheduler.request import Req, Status


@dataclass
class Scheduled:
    """A batch in flight: the requests in batch order and which of them sample."""

    step: int
    reqs: list[Req]
    sample: list[bool]
    num_tokens: int
    msg: ForwardBatch


class Batcher:
    def __init__(self, slots: SlotAllocator, rows: RowAllocator, max_running: int, max_prefill_tokens: int) -> None:
        self.slots, self.rows = slots, rows
        self.max_running = max_running
        self.max_prefill_tokens = max_prefill_tokens
        self.step = 0
        self.released_rows: list[int] = []  # rows freed since the last batch (a diff for the worker)

    def reserved(self, running: list[Req]) -> int:
        """Slots the running requests may still take."""
        return sum(r.max_total_tokens - r.num_computed for r in running)

    def build(self, running: list[Req], waiting: deque[Req]) -> Scheduled | None:
        reqs: list[Req] = []
        extend: list[int] = []
        new_reqs: list[NewReq] = []
        # Decode: one token for every request whose whole sequence but the last token is in KV.
        for r in running:
            if r.prefill_done:
                reqs.append(r)
                extend.append(1)
        budget = self.max_prefill_tokens
        # Prefill: first the chunked requests already running, then admit from the queue (FCFS).
        for r in running:
            if budget > 0 and not r.prefill_done:
                n = min(len(r.seq) - r.num_computed, budget)
                reqs.append(r)
                extend.append(n)
                budget -= n
        free_after_reserve = self.slots.num_free - self.reserved(running)
        while waiting and budget > 0 and len(running) < self.max_running and self.rows.num_free:
            r = waiting[0]
            if r.max_total_tokens > free_after_reserve:
                break  # FCFS: the head waits for memory; later requests do not overtake it
            waiting.popleft()
            free_after_reserve -= r.max_total_tokens
            r.status, r.row = Status.RUNNING, self.rows.alloc()
            running.append(r)
            new_reqs.append(NewReq(rid=r.rid, row=r.row, params=r.params, prefix_slots=i32(r.slots)))
            stage("scheduled", r.rid, queue_ms=round(r.wait_ms(), 3), prompt_tokens=len(r.prompt))
            n = min(len(r.seq) - r.num_computed, budget)
            reqs.append(r)
            extend.append(n)
            budget -= n
        if not reqs:
            return None
        return self._emit(reqs, extend, new_reqs)

    def _emit(self, reqs: list[Req], extend: list[int], new_reqs: list[NewReq]) -> Scheduled:
        prefix, sample, ids, out_slots = [], [], [], []
        for r, n in zip(reqs, extend):
            start = r.num_computed
            prefix.append(start)
            ids.extend(r.seq[start:start + n])
            new = self.slots.alloc(n)
            r.slots.extend(new)
            out_slots.extend(new)
            sample.append(r.num_computed == len(r.seq))
        self.step += 1
        msg = ForwardBatch(
            step=self.step, new_reqs=new_reqs, released_rows=self.released_rows,
            rows=i32([r.row for r in reqs]), prefix_lens=i32(prefix), extend_lens=i32(extend),
            sample=i32(sample), input_ids=i32(ids), out_slots=i32(out_slots))
        self.released_rows = []
        return Scheduled(self.step, reqs, sample, len(ids), msg)
