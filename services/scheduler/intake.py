"""New work from the tokenizer replicas: a ``GenerateReq`` becomes request branches (or is refused
at once with the reason), a ``SessionOp`` / ``UnpinReq`` is answered with a ``Reply``, a ``LoadReq``
with the ``Load``. Only what depends on this scheduler's state is checked here: the edge (the
tokenizer) validated everything else.

Refusals, in order: not serving (UNAVAILABLE), a request id in flight (ALREADY_EXISTS), a prompt +
max_tokens larger than the KV pool (INVALID_ARGUMENT), a full queue — unless lower-priority waiting
requests can be shed for it (``priority.shed_victims``) — (RESOURCE_EXHAUSTED), then what a session
turn or a pin needs (``sessions.py``, ``pins.py``: NOT_FOUND, FAILED_PRECONDITION,
RESOURCE_EXHAUSTED). Shedding happens only once the request is sure to be taken.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from shared.config import SchedulerConfig
from shared.logging import stage
from shared.messages.common import ErrorCode, FinishReason
from shared.messages.to_scheduler import GenerateReq, SessionOp, UnpinReq
from shared.messages.to_tokenizer import Load, Reply, ToTokenizer
from shared.tracing import Tracer, ensure
from services.scheduler.counters import Counters
from services.scheduler.engine import EngineSession
from services.scheduler.hicache import tier_load
from services.scheduler.priority import shed_victims
from services.scheduler.request import Req
from services.scheduler.requests import RequestTable

Refusal = tuple[ErrorCode, str]


class Intake:
    def __init__(self, cfg: SchedulerConfig, table: RequestTable, counters: Counters, tracer: Tracer,
                 send: Callable[[bytes, ToTokenizer], None]) -> None:
        self.cfg, self.table, self.counters, self.tracer, self._send = cfg, table, counters, tracer, send

    def generate(self, ident: bytes, msg: GenerateReq, e: EngineSession | None, down: str) -> None:
        traceparent = ensure(msg.traceparent)
        priority = msg.priority if self.cfg.enable_priority_scheduling else 0
        stage("queued", msg.rid, trace_id=traceparent[3:35], prompt_tokens=len(msg.input_ids), n=msg.n,
              **({"priority": priority} if priority else {}),
              **({"session_id": msg.session.session_id} if msg.session is not None else {}))
        err = self._refusal(msg, e, down)
        shed: list[str] = []
        if err is None:
            shed, err = self._queue_room(msg, priority, e)
        prompt, anchor = list(msg.input_ids), None
        if err is None and msg.session is not None:
            prompt, anchor, err = e.sessions.begin(msg)
        elif err is None and msg.pin is not None:
            anchor, err = e.pins.begin(msg)
        if err is not None:
            self.table.reject(ident, msg.rid, msg.n, *err)
            return
        for rid in shed:
            for r in list(self.table.groups.get(rid, ())):
                self.table.finish(r, FinishReason.ERROR, e.kv, code=ErrorCode.RESOURCE_EXHAUSTED,
                                  error="the queue is full and this request was shed for a higher-priority one: "
                                        "retry later")
            self.counters.shed += 1
        if shed:
            self.table.flush()
        branches: list[Req] = []
        for i in range(msg.n):
            params = msg.params
            if i and params.seed is not None:
                params = msgspec.structs.replace(params, seed=params.seed + i)
            if i and params.scores_prompt:  # the prompt's log-probs come once, with branch 0
                params = msgspec.structs.replace(params, prompt_logprobs_from=-1, prompt_top_logprobs=0)
            span = self.tracer.start("schedule", traceparent, request_id=msg.rid, index=i)
            branches.append(Req(rid=msg.rid, replica=ident, prompt=list(prompt), params=params, index=i,
                                ns=msg.cache_ns, traceparent=span.traceparent, span=span, priority=priority,
                                anchor=anchor))
        self.table.add(branches)
        if msg.constraint is not None:
            e.grammar.submit(branches, msg.constraint)  # joins the queue once compiled
        else:
            self.table.enqueue(branches)

    def _refusal(self, msg: GenerateReq, e: EngineSession | None, down: str) -> Refusal | None:
        if e is None:
            return ErrorCode.UNAVAILABLE, (f"{down}: not serving until a worker is ready" if down else
                                           "the model is not loaded yet")
        if msg.rid in self.table:
            return ErrorCode.ALREADY_EXISTS, f"request_id {msg.rid!r} is already in flight"
        prompt = len(msg.input_ids) + (msg.session.context_tokens if msg.session is not None else 0)
        if prompt + msg.params.max_new_tokens > e.kv.pool_size:
            return ErrorCode.INVALID_ARGUMENT, (f"prompt ({prompt}) + max_tokens ({msg.params.max_new_tokens}) "
                                                f"exceeds the KV pool ({e.kv.pool_size} tokens)")
        return None

    def _queue_room(self, msg: GenerateReq, priority: int, e: EngineSession) -> tuple[list[str], Refusal | None]:
        """Room in the queue: nothing to do, lower-priority requests to shed, or a refusal."""
        queued, limit = num_waiting(self.table, e), self.cfg.max_queued_requests
        if not limit or queued + msg.n <= limit:
            return [], None
        victims = shed_victims(self.table, queued + msg.n - limit, priority) \
            if self.cfg.enable_priority_scheduling else None
        if victims is None:
            return [], (ErrorCode.RESOURCE_EXHAUSTED, f"the queue is full ({queued} requests waiting, limit {limit}): "
                                                      "retry later")
        return victims, None

    def control(self, ident: bytes, msg: SessionOp | UnpinReq, e: EngineSession | None, down: str) -> None:
        if e is None:
            reply = Reply(token=msg.token, error_code=ErrorCode.UNAVAILABLE,
                          error=f"{down}: not serving until a worker is ready" if down else "the model is not loaded yet")
        elif isinstance(msg, SessionOp):
            reply = e.sessions.handle(msg)
        else:
            tokens, err = e.pins.unpin(msg.pin_id)
            reply = Reply(token=msg.token, tokens=tokens) if err is None else \
                Reply(token=msg.token, error_code=err[0], error=err[1])
        self._send(ident, reply)


def num_waiting(table: RequestTable, e: EngineSession | None) -> int:
    """Requests not running yet: queued, or waiting for their grammar to compile."""
    return len(table.waiting) + (e.compiling if e is not None else 0)


def load_of(token: str, c: Counters, table: RequestTable, e: EngineSession | None) -> Load:
    pool = e.kv.pool_size if e is not None else 0
    free = e.kv.slots.num_free if e is not None else 0
    anchors = {}
    if e is not None:
        anchors = dict(num_sessions=len(e.sessions.sessions), session_tokens=e.sessions.tokens,
                       num_pins=len(e.pins.pins), pinned_tokens=e.pins.tokens, max_pinned_tokens=e.pins.budget.limit)
    return Load(token=token, num_running=len(table.running), num_waiting=num_waiting(table, e), kv_free=free,
                kv_used=pool - free, kv_pool=pool, kv_evictable=e.kv.evictable if e is not None else 0,
                steps=c.steps, prefill_computed_tokens=c.prefill_computed, prefill_cached_tokens=c.prefill_cached,
                decode_tokens=c.decode, retractions=c.retractions, evicted_tokens=c.evicted_tokens,
                jump_forward_tokens=c.jump_forward_tokens, preemptions=c.preemptions, shed=c.shed, **anchors,
                **tier_load(c, e.hicache if e is not None else None))
