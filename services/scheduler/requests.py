"""The request table: every request branch the scheduler holds (waiting, compiling, running),
the aborts to apply between steps, and the outbox of what goes back to each tokenizer replica.

A request ends in one place, ``finish``: out of the queue or the running set (its KV released;
then its ``anchor``, a session turn or a pin, is told), then its final ``TokenOut``, ``finished``
stage line and span. Outputs are collected per replica
and sent together by ``flush`` (one ``TokenOutBatch`` per replica per step).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator

from shared.logging import stage
from shared.messages.common import ErrorCode, FinishReason
from shared.messages.to_scheduler import AbortReq
from shared.messages.to_tokenizer import ToTokenizer, TokenOut, TokenOutBatch
from services.scheduler.kv import KVManager
from services.scheduler.request import Req, Status


def token_out(r: Req, **final) -> TokenOut:
    """The tokens (and logprobs) ``r`` produced since its last output."""
    prompt = {}
    if r.params.prompt_logprobs_from >= 0 and not r.prompt_lp_sent and (final or r.unsent):
        prompt = dict(prompt_logprobs=r.prompt_logprobs, prompt_top_ids=r.prompt_top_ids,  # (once: the first
                      prompt_top_logprobs=r.prompt_top_logprobs)  # output with tokens, or the last)
        r.prompt_lp_sent = True
    out = TokenOut(rid=r.rid, index=r.index, token_ids=r.output[len(r.output) - r.unsent:],
                   cached_tokens=r.cached_tokens, logprobs=r.unsent_logprobs, top_ids=r.unsent_top_ids,
                   top_logprobs=r.unsent_top_logprobs, **prompt, **final)
    r.unsent, r.unsent_logprobs, r.unsent_top_ids, r.unsent_top_logprobs = 0, [], [], []
    return out


class RequestTable:
    def __init__(self, send: Callable[[bytes, ToTokenizer], None]) -> None:
        self.groups: dict[str, list[Req]] = {}  # rid → its branches (n of them)
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self._aborts: list[Req] = []
        self._outbox: dict[bytes, list[TokenOut]] = {}
        self._urgent: dict[bytes, list[tuple[int, int, TokenOut]]] = {}  # (priority > 0, order, output)
        self._send = send

    def __contains__(self, rid: str) -> bool:
        return rid in self.groups

    def add(self, branches: list[Req]) -> None:
        """A new request: its branches are held (they join the queue via ``enqueue``)."""
        self.groups[branches[0].rid] = branches

    def enqueue(self, branches: list[Req]) -> None:
        self.waiting.extend(r for r in branches if r.status is Status.WAITING and r.aborted is None)

    def live(self) -> Iterator[Req]:
        """Every branch not finished: waiting, compiling, running."""
        return (r for branches in list(self.groups.values()) for r in branches if r.status is not Status.FINISHED)

    # ---- aborts ------------------------------------------------------------------------------
    def abort(self, ident: bytes, msg: AbortReq) -> None:
        """Mark the branches ``msg`` names (of requests from replica ``ident``) to stop at the next
        step boundary (a running request may be in the batch in flight)."""
        for r in self.groups.get(msg.rid, ()):
            if r.replica == ident and msg.index in (-1, r.index) and r.status is not Status.FINISHED:
                r.aborted = msg.reason
                r.keep_output = msg.output_tokens
                self._aborts.append(r)

    def apply_aborts(self, kv: KVManager) -> None:
        for r in self._aborts:
            if r.status is not Status.FINISHED:
                self.finish(r, r.aborted, kv)
        self._aborts.clear()

    # ---- ending ------------------------------------------------------------------------------
    def finish(self, r: Req, reason: FinishReason, kv: KVManager | None, error: str = "",
               code: ErrorCode | None = None) -> None:
        self.end(r, reason, kv)
        self.report(r, reason, error, code)

    def end(self, r: Req, reason: FinishReason, kv: KVManager | None) -> None:
        """``r`` stops: out of the running set or the queue, its KV released (kept in the cache
        unless it failed: its KV may be bad)."""
        if r.status is Status.RUNNING:
            self.running.remove(r)
            if kv is not None:
                kv.release(r, keep=reason is not FinishReason.ERROR)
        elif r.status is Status.WAITING and r in self.waiting:  # (else: compiling, or retracted while its
            self.waiting.remove(r)  # last token was in flight)
        r.status, r.finish = Status.FINISHED, reason
        if r.anchor is not None:  # a session turn or a pin: its KV is in the cache now
            r.anchor.ended(r, reason, kv)
        if all(b.status is Status.FINISHED for b in self.groups.get(r.rid, ())):
            self.groups.pop(r.rid, None)

    def report(self, r: Req, reason: FinishReason, error: str = "", code: ErrorCode | None = None) -> None:
        """The final TokenOut, stage line and span of a request that ended."""
        self.emit(r.replica, token_out(r, finish=reason, error=error, error_code=code, prompt_tokens=len(r.prompt),
                                       completion_tokens=len(r.output)), r.priority)
        stage("finished", r.rid, trace_id=r.trace_id, index=r.index, finish_reason=reason,
              completion_tokens=len(r.output), cached_tokens=r.cached_tokens, e2e_ms=round(r.wait_ms(), 3))
        if r.span is not None:
            r.span.end(finish_reason=reason, prompt_tokens=len(r.prompt), completion_tokens=len(r.output),
                       cached_tokens=r.cached_tokens, retractions=r.retractions)

    def fail_all(self, message: str, code: ErrorCode, kv: KVManager | None) -> int:
        """End every branch with an error (the worker was lost); → how many there were."""
        live = list(self.live())
        for r in live:
            self.finish(r, FinishReason.ERROR, kv, error=message, code=code)
        self.waiting.clear()
        self.running.clear()
        self._aborts.clear()
        return len(live)

    # ---- outbox ------------------------------------------------------------------------------
    def emit(self, ident: bytes, out: TokenOut, priority: int = 0) -> None:
        """Queue ``out`` for replica ``ident``. In a step's batch the outputs of requests above
        priority 0 go first, highest first (the replica handles them in order: under load an urgent
        request's token does not wait behind hundreds of background ones)."""
        box = self._outbox.setdefault(ident, [])
        if priority > 0:
            urgent = self._urgent.setdefault(ident, [])
            urgent.append((priority, len(urgent), out))
        else:
            box.append(out)

    def reject(self, ident: bytes, rid: str, n: int, code: ErrorCode, error: str) -> None:
        """Refuse a new request at once (every branch ends with the error)."""
        for i in range(max(1, n)):
            self.emit(ident, TokenOut(rid=rid, index=i, finish=FinishReason.ERROR, error=error, error_code=code))
        self.flush()

    def flush(self) -> None:
        for ident, outs in self._outbox.items():
            urgent = self._urgent.pop(ident, None)
            if urgent:  # (highest first; in emission order within a level)
                outs = [o for _, _, o in sorted(urgent, key=lambda u: (-u[0], u[1]))] + outs
            self._send(ident, TokenOutBatch(outs=outs))
        self._outbox.clear()
