"""Applying one step's results in the scheduler: sampled tokens into their requests, grammar
matchers advanced, jump-forward, finish checks, then what goes back to the tokenizers.

With overlap scheduling the next step is already on the worker and, when it has constrained rows,
the worker waits for their bitmask (``StepMask``), which needs the matchers advanced by this
step's tokens. So the work is split: first everything the mask depends on (tokens, matchers,
jump-forward, which requests end, their KV released), then the mask goes out, then the rest
(TokenOut messages, stage logs, spans) while the worker samples.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shared.logging import get_logger, stage
from shared.messages.common import from_i32
from shared.messages.to_scheduler import StepOutput
from services.scheduler.batcher import Scheduled
from services.scheduler.request import Req, Status
from services.scheduler.step_io import StepLogprobs, deferred_mask, take_prompt_logprobs, token_out

if TYPE_CHECKING:
    from services.scheduler.scheduler import Scheduler

log = get_logger("scheduler")


def send_mask(s: Scheduler, mask_for: Scheduled | None) -> None:
    """The deferred bitmask of the step in flight (``mask_for``), from the matchers as they are."""
    if mask_for is not None:
        s.worker.send(deferred_mask(mask_for, s.grammar))


def process_step(s: Scheduler, sched: Scheduled, out: StepOutput, mask_for: Scheduled | None = None) -> None:
    c, ctx = s.counters, s.info.context_length
    c.prefill_computed += sched.prefill_tokens
    c.decode += sched.num_tokens - sched.prefill_tokens
    lps = StepLogprobs(out)
    take_prompt_logprobs(sched, out)
    starts = from_i32(sched.msg.prefix_lens).tolist()
    report: list[tuple[Req, str, float]] = []  # (request, finish reason or "", ttft ms or -1)
    for i, (r, sample, tok) in enumerate(zip(sched.reqs, sched.sample, from_i32(out.next_ids).tolist())):
        if not sample:
            if r.status is Status.RUNNING:
                s.kv.cache_prefix(r)  # a prefill chunk: share it with requests arriving meanwhile
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
            s.kv.cache_prefix(r)
        ttft = -1.0
        if r.params.max_new_tokens == 0 or not r.output:
            c.prefill_cached += r.cached_tokens
            c.prompt += len(r.prompt)
            if r.params.max_new_tokens == 0:  # scoring: the prompt is all it wanted
                s._end(r, "length")
                report.append((r, "length", -1.0))
                continue
            ttft = r.wait_ms()
        r.output.append(tok)
        r.unsent += 1
        if r.params.logprobs:
            lps.take(i, r)
        reason = grammar_finish(s, r, tok) if r.matcher is not None else ""
        reason = reason or r.check_finished(ctx)
        if not reason and r.matcher is not None and jump_forward_ok(s, r):
            forced = s.grammar.jump_forward(r.matcher, r.remaining_new_tokens)
            if forced:
                r.output += forced
                r.unsent += len(forced)
                r.discard = r.pending  # steps in flight sample after the old end: drop their tokens
                s.jump_forward_tokens += len(forced)
                reason = grammar_done(s, r) or r.check_finished(ctx)
        if reason:
            s._end(r, reason)
        report.append((r, reason, ttft))
    send_mask(s, mask_for)
    for r, reason, ttft in report:
        if ttft >= 0:
            stage("first_token", r.rid, trace_id=r.trace_id, index=r.index, ttft_ms=round(ttft, 3))
        if reason:
            s._report(r, reason)
        else:
            s._emit(r.replica, token_out(r))


def grammar_finish(s: Scheduler, r: Req, tok: int) -> str:
    """Advance the matcher; "stop" when the grammar ended (EOS taken, or nothing but EOS left)."""
    if not r.matcher.accept_token(tok):
        log.error("grammar_rejected_token", request_id=r.rid, token=tok)
        return "stop"
    return grammar_done(s, r)


def grammar_done(s: Scheduler, r: Req) -> str:
    return "stop" if r.matcher.is_terminated() or s.grammar.only_stop_left(r.matcher) else ""


def jump_forward_ok(s: Scheduler, r: Req) -> bool:
    """Forced tokens carry no logprobs and are not seen by the worker's penalty counts."""
    return not (s.cfg.disable_jump_forward or r.params.logprobs or r.params.penalized)
