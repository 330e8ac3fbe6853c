"""Sessions: multi-turn conversations whose tokens the server keeps and whose KV it pins.

A session (``OpenSession``: idle TTL, token capacity, cache namespace) is a tree of *turns*: each
turn is a token sequence, the one it continued (its parent) followed by the turn's input and the
tokens generated. The empty start is the turn ``""``. A ``GenerateReq`` with a ``SessionTurn``
continues one turn (the tokenizer resolves "the latest" to a turn id before it tokenizes): its
prompt is that turn's tokens + its input ids. When it ends with stop or length, prompt + output
(what the client got: a stop string's cut is respected) become the session's turn named by the
request id, and the session holds a lock on it through the ``PrefixCache`` interface
(``KVManager.pin``): the KV of every turn is exempt from eviction, so the next turn finds all of
it cached however much other traffic passed in between. Two turns may continue the same parent
(branching); they share its prefix. An aborted or failed turn adds nothing.

**Limits.** ``capacity`` bounds the session's unique tokens (each turn adds its own length minus
its parent's); a turn that could pass it (input + max_tokens) is refused with FAILED_PRECONDITION.
Every session's tokens count against the pinned-token budget shared with pinned prefixes
(``pins.PinBudget``: RESOURCE_EXHAUSTED when full). A session idle (no turn running) for its TTL
expires; ``CloseSession`` ends it at once; either unlocks its turns. A later turn gets NOT_FOUND,
saying which. Sessions live as long as the worker's KV: a lost worker loses them.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from shared.messages.common import ErrorCode, FinishReason
from shared.messages.to_scheduler import GenerateReq, SessionOp, SessionOpKind
from shared.messages.to_tokenizer import Reply, SessionView
from services.scheduler.cache import CacheHandle
from services.scheduler.kv import KVManager
from services.scheduler.pins import EXPIRY_CHECK_S, PinBudget, Refusal
from services.scheduler.request import Req

MAX_SESSIONS = 4096
MAX_TURNS = 64  # turns a session remembers (the oldest other than the latest are forgotten past this)
REMEMBERED_ENDS = 4096  # ended sessions whose end NOT_FOUND can name (closed / expired)


@dataclass
class Turn:
    tokens: list[int]
    handle: CacheHandle | None = None  # the lock the session holds on its KV (None: the empty start)


@dataclass
class Session:
    sid: str
    ns: str
    ttl_s: float
    capacity: int
    expires: float
    turns: dict[str, Turn] = field(default_factory=lambda: {"": Turn([])})
    head: str = ""  # the latest turn
    size: int = 0  # unique tokens of its turns (pinned, counted in the budget)
    reserved: int = 0  # what its turns in flight may add
    in_flight: int = 0

    def view(self, parent: str) -> SessionView:
        return SessionView(session_id=self.sid, parent=parent, length=len(self.turns[parent].tokens),
                           capacity=self.capacity, capacity_left=self.capacity - self.size - self.reserved,
                           cache_ns=self.ns, ttl_s=self.ttl_s)


class TurnAnchor:
    """A running turn's hook: its reservation is released and, if it completed, it is committed."""

    def __init__(self, sessions: Sessions, s: Session, base: int, growth: int) -> None:
        self.sessions, self.session, self.base, self.growth = sessions, s, base, growth  # base: its parent's length

    def ended(self, r: Req, reason: FinishReason, kv: KVManager | None) -> None:
        s, sessions = self.session, self.sessions
        s.reserved -= self.growth
        s.in_flight -= 1
        sessions.budget.reserved -= self.growth
        s.expires = sessions.clock() + s.ttl_s
        if reason in (FinishReason.STOP, FinishReason.LENGTH) and kv is not None and sessions.get(s.sid) is s:
            out = r.output if r.keep_output < 0 else r.output[:r.keep_output]
            sessions.commit(s, r.rid, r.prompt + out, len(r.prompt + out) - self.base)


class Sessions:
    def __init__(self, kv: KVManager, budget: PinBudget, context_length: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.kv, self.budget, self.context_length, self.clock = kv, budget, context_length, clock
        self.sessions: dict[str, Session] = {}
        self._ended: OrderedDict[str, str] = OrderedDict()  # sid → "closed" / "expired after …"
        self._next_check = 0.0
        self.tokens = 0  # the sessions' sizes together (read every step by the metrics)

    def get(self, sid: str) -> Session | None:
        return self.sessions.get(sid)

    def _missing(self, sid: str) -> Refusal:
        why = self._ended.get(sid)
        return ErrorCode.NOT_FOUND, (f"session {sid!r} {why}" if why else f"session {sid!r} does not exist (never "
                                     "opened here, or lost when the worker restarted)")

    # ---- SessionOp ---------------------------------------------------------------------------
    def handle(self, op: SessionOp) -> Reply:
        if op.op is SessionOpKind.OPEN:
            return self._open(op)
        s = self.sessions.get(op.session_id)
        if s is None:
            code, error = self._missing(op.session_id)
            return Reply(token=op.token, error_code=code, error=error)
        if op.op is SessionOpKind.CLOSE:
            size = s.size
            self._end(s, "was closed")
            return Reply(token=op.token, tokens=size)
        parent = op.parent or s.head
        if parent not in s.turns:
            return Reply(token=op.token, error_code=ErrorCode.NOT_FOUND,
                         error=f"session {s.sid!r} has no turn {parent!r} (session_parent)")
        return Reply(token=op.token, session=s.view(parent))

    def _open(self, op: SessionOp) -> Reply:
        def refuse(code: ErrorCode, error: str) -> Reply:
            return Reply(token=op.token, error_code=code, error=error)

        if op.session_id in self.sessions:
            return refuse(ErrorCode.ALREADY_EXISTS, f"session {op.session_id!r} exists already")
        if len(self.sessions) >= MAX_SESSIONS:
            return refuse(ErrorCode.RESOURCE_EXHAUSTED, f"{MAX_SESSIONS} sessions are open already: close some")
        capacity = op.capacity or min(self.context_length, self.budget.limit)
        if capacity > self.budget.limit:
            return refuse(ErrorCode.INVALID_ARGUMENT, f"capacity {capacity} is more than sessions and pinned "
                          f"prefixes may pin together (--max-pinned-tokens {self.budget.limit})")
        s = Session(op.session_id, op.cache_ns, op.ttl_s, capacity, self.clock() + op.ttl_s)
        self.sessions[s.sid] = s
        return Reply(token=op.token, session=s.view(""))

    # ---- turns -------------------------------------------------------------------------------
    def begin(self, msg: GenerateReq) -> tuple[list[int], TurnAnchor | None, Refusal | None]:
        """A turn arrives: (its whole prompt, its anchor — the tokens it may add reserved —, None),
        or ([], None, why it is refused)."""
        t = msg.session
        assert t is not None
        s = self.sessions.get(t.session_id)
        if s is None:
            return [], None, self._missing(t.session_id)
        parent = s.turns.get(t.parent)
        if parent is None or len(parent.tokens) != t.context_tokens:
            return [], None, (ErrorCode.NOT_FOUND, f"session {s.sid!r} has no turn {t.parent!r} (session_parent; "
                                                   f"a session remembers its latest {MAX_TURNS} turns)")
        if msg.rid in s.turns:
            return [], None, (ErrorCode.ALREADY_EXISTS, f"session {s.sid!r} has a turn {msg.rid!r} already")
        if msg.n != 1 or msg.cache_ns != s.ns:
            return [], None, (ErrorCode.INVALID_ARGUMENT, "a session turn has n = 1 and the session's cache_salt")
        prompt = parent.tokens + list(msg.input_ids)
        max_new = msg.params.max_new_tokens
        if len(prompt) + max_new > self.context_length:
            return [], None, (ErrorCode.FAILED_PRECONDITION, f"session {s.sid!r}: its {len(parent.tokens)} tokens + "
                              f"{len(msg.input_ids)} new + max_tokens {max_new} exceed the context window of "
                              f"{self.context_length}")
        growth = len(msg.input_ids) + max_new
        if s.size + s.reserved + growth > s.capacity:
            return [], None, (ErrorCode.FAILED_PRECONDITION, f"session {s.sid!r} is full: it holds {s.size} of its "
                              f"{s.capacity} tokens ({s.reserved} more reserved by turns in flight) and this turn may "
                              f"add {growth} (its {len(msg.input_ids)} input tokens + max_tokens {max_new})")
        err = self.budget.refusal(growth, f"this session turn ({len(msg.input_ids)} input tokens + max_tokens "
                                          f"{max_new})")
        if err is not None:
            return [], None, err
        s.reserved += growth
        s.in_flight += 1
        self.budget.reserved += growth
        return prompt, TurnAnchor(self, s, len(parent.tokens), growth), None

    def commit(self, s: Session, turn_id: str, tokens: list[int], grown: int) -> None:
        """A turn completed: it joins the session (``grown`` tokens longer than its parent), its KV
        pinned (the tree holds it: the request's KV went into the cache as it ended)."""
        handle, _ = self.kv.pin(s.ns, tokens)
        s.turns[turn_id] = Turn(tokens, handle)
        s.head = turn_id
        s.size += grown
        self.tokens += grown
        self.budget.used += grown
        if len(s.turns) > MAX_TURNS + 1:  # forget the oldest turn but the start and the latest (its KV stays
            old = next(k for k in s.turns if k not in ("", s.head))  # pinned through the later turns' locks)
            self.kv.unpin(s.turns.pop(old).handle)

    # ---- endings -----------------------------------------------------------------------------
    def _end(self, s: Session, why: str) -> None:
        del self.sessions[s.sid]
        for turn in s.turns.values():
            if turn.handle is not None:
                self.kv.unpin(turn.handle)
        self.budget.used -= s.size
        self.tokens -= s.size
        s.size = 0
        self._ended[s.sid] = why
        while len(self._ended) > REMEMBERED_ENDS:
            self._ended.popitem(last=False)

    def expire(self, now: float) -> None:
        """End the sessions idle past their TTL (a turn in flight keeps its session open)."""
        if now < self._next_check:
            return
        self._next_check = now + EXPIRY_CHECK_S
        for s in [s for s in self.sessions.values() if s.in_flight == 0 and s.expires <= now]:
            self._end(s, f"expired ({s.ttl_s:g} s without a turn)")
