"""One generation, independent of the API front: submit to the scheduler, detokenize each branch
incrementally, apply stop strings, and abort downstream when the caller goes away. Its latencies
and token counts go to the metrics once it ends; its ``generate`` span covers received → sent."""

from __future__ import annotations

import time

import msgspec
from collections.abc import AsyncIterator
from dataclasses import dataclass

from shared.errors import BY_WIRE_CODE, Internal
from shared.logging import stage
from shared.messages.common import FinishReason
from shared.tracing import Trace, Tracer
from services.tokenizer.detokenizer import IncrementalDetokenizer
from services.tokenizer.metrics import TokenizerMetrics
from services.tokenizer.router import Route
from services.tokenizer.scheduler_client import SchedulerClient
from services.tokenizer.text import TextProcessor
from services.tokenizer.validation import Prepared


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float | None  # None only for a prompt's first token (nothing comes before it)
    top: list[tuple[int, float]]  # the most likely alternatives (token id, logprob)


@dataclass(frozen=True)
class Chunk:
    """New output of one branch. ``finish`` (STOP, LENGTH or ABORT) and ``usage`` are set on
    the branch's last chunk."""

    index: int
    token_ids: list[int]
    text: str
    finish: FinishReason | None = None
    usage: Usage | None = None
    matched_stop: str = ""
    matched_stop_token_id: int | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token id, when asked for
    # Prompt log-probs (SamplingRequest.prompt_logprobs_start), on branch 0's first chunk: one per prompt
    # token from that position on (a session turn's positions count from its own input's start).
    prompt_logprobs: list[TokenLogprob] | None = None


def _logprobs(out) -> list[TokenLogprob] | None:
    if not out.logprobs:
        return None
    tops = out.top_ids or [[] for _ in out.logprobs]
    top_lps = out.top_logprobs or [[] for _ in out.logprobs]
    return [TokenLogprob(t, lp, list(zip(ids, lps)))
            for t, lp, ids, lps in zip(out.token_ids, out.logprobs, tops, top_lps)]


def _prompt_logprobs(out, p: Prepared) -> list[TokenLogprob] | None:
    """The prompt log-probs ``out`` carries, one per input token from the asked start on."""
    params = p.req.params
    if out.index or not params.scores_prompt or not (out.prompt_logprobs or out.token_ids or out.finish):
        return None
    ids, ctx = p.req.input_ids, p.context_tokens
    first, tops = params.first_scored, out.prompt_top_ids
    res = []
    for pos in range(params.prompt_logprobs_from, ctx + len(ids)):
        k = pos - first
        if k < 0 or k >= len(out.prompt_logprobs):
            res.append(TokenLogprob(ids[pos - ctx], None, []))
            continue
        top = list(zip(tops[k], out.prompt_top_logprobs[k])) if k < len(tops) else []
        res.append(TokenLogprob(ids[pos - ctx], out.prompt_logprobs[k], top))
    return res


class _Branch:
    def __init__(self, detok: IncrementalDetokenizer) -> None:
        self.detok = detok
        self.generated = 0
        self.cached = 0
        self.done = False
        self.finish: FinishReason | None = None
        self.started = False  # the scheduler took it (an output arrived)
        self.last = 0.0  # when its last tokens arrived
        self.gaps: list[float] = []  # inter-token latencies, one per token after the first
        self.held: Chunk | None = None  # a session turn's last chunk, until the scheduler confirms its end
        self.prompt_sent = False  # its prompt log-probs went out


class Generator:
    def __init__(self, text: TextProcessor, client: SchedulerClient, metrics: TokenizerMetrics | None = None,
                 tracer: Tracer | None = None) -> None:
        self.text = text
        self.client = client
        self.metrics = metrics
        self.tracer = tracer or Tracer()

    async def stream(self, p: Prepared, rid: str, trace: Trace | None = None,
                     group: int | None = None) -> AsyncIterator[Chunk]:
        """Chunks of every branch as they come; ends when all branches are done. Closing the
        iterator early (client cancel, disconnect, deadline) aborts the request downstream.
        ``trace``: the request's trace context and when it was received (default: now, a new trace);
        ``group``: the data-parallel group to run it in (default: the router's choice)."""
        trace = trace or Trace.incoming(None)
        span = self.tracer.start("generate", trace.traceparent, trace.start_ns, request_id=rid,
                                 prompt_tokens=p.prompt_tokens, n=p.req.n)
        req = msgspec.structs.replace(p.req, rid=rid, traceparent=span.traceparent)
        branches = [_Branch(IncrementalDetokenizer(self.text.tokenizer, req.input_ids, p.skip_special_tokens, p.stop))
                    for _ in range(req.n)]
        live = req.n
        first = 0.0
        try:
            await self.client.watch.wait_serving()  # a scheduler restarting: wait for it (bounded)
        except BaseException:  # (the caller went away while it waited)
            self._ended(trace, span, p, branches, first, FinishReason.ABORT)
            raise
        try:
            queue = self.client.submit(req, Route(group, 0, "pinned") if group is not None else None)
        except Exception:
            self._ended(trace, span, p, branches, first, FinishReason.ERROR)
            raise
        try:
            async for out in self.client.stream(queue):
                b = branches[out.index]
                if b.held is not None:  # a session turn cut by a stop string: it ends once the scheduler has
                    if out.finish:  # taken the cut (so the session's next turn, on any replica, continues it)
                        chunk, b.held, b.done, live = b.held, None, True, live - 1
                        yield chunk
                        if live == 0:
                            stage("sent", rid, trace_id=trace.trace_id,
                                  completion_tokens=sum(x.generated for x in branches))
                            return
                    continue
                if b.done:
                    continue
                if out.finish is FinishReason.ERROR:
                    live = 0
                    for x in branches:
                        x.finish = x.finish or FinishReason.ERROR
                    raise BY_WIRE_CODE.get(out.error_code, Internal)(out.error)
                b.started = True
                if out.token_ids:
                    now = time.monotonic()
                    if not first:
                        first = now
                        stage("first_out", rid, trace_id=trace.trace_id)  # (the tokenizer has it: on its way out)
                        if self.metrics is not None:
                            self.metrics.ttft.observe(now - trace.start)
                    # per token after the branch's first: tokens that came together share the gap
                    # (jump-forward spans; outputs merged while the replica was busy)
                    k = len(out.token_ids)
                    if b.last:
                        b.gaps.extend([(now - b.last) / k] * k)
                    else:
                        b.gaps.extend([0.0] * (k - 1))
                    b.last = now
                b.generated += len(out.token_ids)
                b.cached = max(b.cached, out.cached_tokens)
                text = b.detok.push(out.token_ids)
                lps = _logprobs(out)
                plps = None if b.prompt_sent else _prompt_logprobs(out, p)
                b.prompt_sent = b.prompt_sent or plps is not None
                if not (b.detok.stopped or out.finish):
                    yield Chunk(out.index, out.token_ids, text, logprobs=lps, prompt_logprobs=plps)
                    continue
                b.finish = FinishReason.STOP if b.detok.stopped else out.finish
                usage = Usage(p.prompt_tokens, b.generated, b.cached)
                if b.detok.stopped:
                    final = Chunk(out.index, out.token_ids, text, FinishReason.STOP, usage,
                                  matched_stop=b.detok.matched_stop, logprobs=lps, prompt_logprobs=plps)
                    if not out.finish:
                        self.client.abort(rid, FinishReason.STOP, out.index, b.generated)
                        if req.session is not None:
                            b.held = final
                            continue
                    b.done, live = True, live - 1
                    yield final
                else:
                    b.done, live = True, live - 1
                    last = out.token_ids[-1] if out.token_ids else None
                    stop_id = last if out.finish is FinishReason.STOP and last in req.params.stop_token_ids else None
                    yield Chunk(out.index, out.token_ids, text + b.detok.finish(), out.finish, usage,
                                matched_stop_token_id=stop_id, logprobs=lps, prompt_logprobs=plps)
                if live == 0:
                    stage("sent", rid, trace_id=trace.trace_id, completion_tokens=sum(x.generated for x in branches))
                    return
        finally:
            if live:  # the caller went away (cancel, deadline, disconnect): free its KV
                self.client.abort(rid)
                stage("cancelled", rid, trace_id=trace.trace_id,
                      completion_tokens=sum(x.generated for x in branches))
            self.client.release(rid)
            self._ended(trace, span, p, branches, first, FinishReason.ABORT)

    def _ended(self, trace: Trace, span, p: Prepared, branches: list[_Branch], first: float,
               unfinished: FinishReason) -> None:
        """Metrics and span of a request that ended; branches without a finish reason get ``unfinished``."""
        reasons = [b.finish or unfinished for b in branches]
        started = [b for b in branches if b.started]
        prompt = p.prompt_tokens if started else 0
        generated = sum(b.generated for b in branches)
        if self.metrics is not None:
            done = all(b.done for b in branches)
            self.metrics.request_ended(time.monotonic() - trace.start if done else None,
                                       [g for b in branches for g in b.gaps], prompt, generated,
                                       min((b.cached for b in started), default=0), reasons)
        span.end(finish_reason=",".join(sorted(set(reasons))), completion_tokens=generated,
                 ttft_s=first - trace.start if first else -1.0)
