"""Applying one step's results in the scheduler: sampled tokens into their requests, grammar
matchers advanced, jump-forward, finish checks, then what goes back to the tokenizers.

With overlap scheduling the next step is already on the worker and, when it has constrained rows,
the worker waits for their bitmask (``StepMask``), which needs the matchers advanced by this
step's tokens. So the work is split: first everything the mask depends on (tokens, matchers,
jump-forward, which requests end, their KV released), then the mask goes out, then the rest
(TokenOut messages, stage logs, spans) while the worker samples.
"""

from __future__ import annotations

from collections.abc import Callable

from shared.logging import get_logger, stage
from shared.messages.common import ErrorCode, FinishReason, from_i32
from shared.messages.to_scheduler import StepOutput, WorkerError
from shared.messages.to_worker import StepMask
from services.scheduler.batcher import Scheduled
from services.scheduler.counters import Counters
from services.scheduler.engine import EngineSession
from services.scheduler.request import Req, Status
from services.scheduler.requests import RequestTable, token_out
from services.scheduler.step_io import StepLogprobs, deferred_mask, take_prompt_logprobs

log = get_logger("scheduler")


class StepApplier:
    """Applies the worker's answers to the requests of one engine session."""

    def __init__(self, table: RequestTable, engine: EngineSession, counters: Counters,
                 send_mask: Callable[[StepMask], None], jump_forward: bool = True) -> None:
        self.table, self.engine, self.counters = table, engine, counters
        self.kv, self.grammar = engine.kv, engine.grammar
        self._send_mask = send_mask
        self.jump_forward = jump_forward
        self.context_length = engine.info.context_length
        # priority scheduling: (priority, seconds queued → first token) of each request, drained by the metrics
        self.first_tokens: list[tuple[int, float]] | None = None

    def send_mask(self, mask_for: Scheduled | None) -> None:
        """The deferred bitmask of the step in flight (``mask_for``), from the matchers as they are."""
        if mask_for is not None:
            self._send_mask(deferred_mask(mask_for, self.grammar))

    def fail(self, sched: Scheduled, err: WorkerError, mask_for: Scheduled | None = None) -> None:
        """The worker could not run ``sched``: its requests fail (the process lives on)."""
        log.error("worker_step_failed", step=sched.step_id, error=err.message)
        for r, sample in zip(sched.reqs, sched.emits):
            if sample:  # (a retracted request waits for this token: it resumes without it)
                r.pending -= 1
                r.discard = min(r.discard, r.pending)
            if r.status is Status.RUNNING:
                self.table.finish(r, FinishReason.ERROR, self.kv, error=f"worker failed: {err.message}",
                                  code=ErrorCode.INTERNAL)
        self.send_mask(mask_for)

    def apply(self, sched: Scheduled, out: StepOutput, mask_for: Scheduled | None = None) -> None:
        c, kv, table = self.counters, self.kv, self.table
        lps = StepLogprobs(out)
        take_prompt_logprobs(sched, out)
        starts = from_i32(sched.msg.prefix_lens).tolist()
        report: list[tuple[Req, FinishReason | None, float]] = []  # (request, finish reason, ttft ms or -1)
        for i, (r, sample, tok) in enumerate(zip(sched.reqs, sched.emits, from_i32(out.next_ids).tolist())):
            if not sample:  # a prefill chunk: share it with requests arriving meanwhile (not a forced
                if r.status is Status.RUNNING and (sched.extend[i] > 1 or starts[i] < len(r.prompt)):  # token's
                    kv.cache_prefix(r)  # own row: ``split_output_chunks``)
                continue
            r.pending -= 1
            if r.status is Status.FINISHED:
                continue
            if r.discard:  # overlap: jump-forward replaced what this step sampled
                r.discard -= 1
                continue
            # the last prompt chunk: others may share it (a jump-forward chunk is this request's own; its
            # KV joins the cache when the request ends)
            if r.status is Status.RUNNING and (not r.output or starts[i] < len(r.prompt)):
                kv.cache_prefix(r)
            ttft = -1.0
            if r.params.max_new_tokens == 0 or not r.output:
                c.prefill_cached += r.cached_tokens
                c.prompt += len(r.prompt)
                if r.params.max_new_tokens == 0:  # scoring: the prompt is all it wanted
                    table.end(r, FinishReason.LENGTH, kv)
                    report.append((r, FinishReason.LENGTH, -1.0))
                    continue
                ttft = r.wait_ms()
            r.output.append(tok)
            r.unsent += 1
            if r.params.logprobs:
                lps.take(i, r)
            reason = self._accept(r, tok) if r.matcher is not None else None
            reason = reason or r.check_finished(self.context_length)
            if reason is None and r.matcher is not None and self._may_jump(r):
                forced = self.grammar.jump_forward(r.matcher, r.remaining_new_tokens)
                if forced:
                    r.output += forced
                    r.unsent += len(forced)
                    r.discard = r.pending  # steps in flight sample after the old end: drop their tokens
                    c.jump_forward_tokens += len(forced)
                    reason = self._grammar_done(r) or r.check_finished(self.context_length)
            if reason is not None:
                table.end(r, reason, kv)
            report.append((r, reason, ttft))
        self.send_mask(mask_for)
        for r, reason, ttft in report:
            if ttft >= 0:
                if self.first_tokens is not None:
                    self.first_tokens.append((r.priority, ttft / 1e3))
                stage("first_token", r.rid, trace_id=r.trace_id, index=r.index, ttft_ms=round(ttft, 3))
            if reason is not None:
                table.report(r, reason)
            elif ttft >= 0 or r.unsent >= r.params.stream_interval:  # (the first at once, then every interval)
                table.emit(r.replica, token_out(r), r.priority)

    def _accept(self, r: Req, tok: int) -> FinishReason | None:
        """Advance the matcher; STOP when the grammar ended (EOS taken, or nothing but EOS left)."""
        if not r.matcher.accept_token(tok):
            log.error("grammar_rejected_token", request_id=r.rid, token=tok)
            return FinishReason.STOP
        return self._grammar_done(r)

    def _grammar_done(self, r: Req) -> FinishReason | None:
        done = r.matcher.is_terminated() or self.grammar.only_stop_left(r.matcher)
        return FinishReason.STOP if done else None

    def _may_jump(self, r: Req) -> bool:
        """Forced tokens carry no logprobs and are not seen by the worker's penalty counts (or its
        logit processors' state)."""
        return self.jump_forward and not (r.params.logprobs or r.params.penalized or r.params.processed)
