"""One generation, independent of the API front: submit to the scheduler, detokenize each branch
incrementally, apply stop strings, and abort downstream when the caller goes away."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from shared.errors import BY_WIRE_CODE, Internal
from shared.logging import stage
from services.tokenizer.detokenizer import IncrementalDetokenizer
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
    logprob: float
    top: list[tuple[int, float]]  # the most likely alternatives (token id, logprob)


@dataclass(frozen=True)
class Chunk:
    """New output of one branch. ``finish`` ("stop" | "length" | "abort") and ``usage`` are set on
    the branch's last chunk."""

    index: int
    token_ids: list[int]
    text: str
    finish: str = ""
    usage: Usage | None = None
    matched_stop: str = ""
    matched_stop_token_id: int | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token id, when asked for


def _logprobs(out) -> list[TokenLogprob] | None:
    if not out.logprobs:
        return None
    tops = out.top_ids or [[] for _ in out.logprobs]
    top_lps = out.top_logprobs or [[] for _ in out.logprobs]
    return [TokenLogprob(t, lp, list(zip(ids, lps)))
            for t, lp, ids, lps in zip(out.token_ids, out.logprobs, tops, top_lps)]


class _Branch:
    def __init__(self, detok: IncrementalDetokenizer) -> None:
        self.detok = detok
        self.generated = 0
        self.cached = 0
        self.done = False


class Generator:
    def __init__(self, text: TextProcessor, client: SchedulerClient) -> None:
        self.text = text
        self.client = client

    async def stream(self, p: Prepared, rid: str, traceparent: str = "") -> AsyncIterator[Chunk]:
        """Chunks of every branch as they come; ends when all branches are done. Closing the
        iterator early (client cancel, disconnect, deadline) aborts the request downstream."""
        queue = self.client.submit(rid, p.input_ids, p.params, p.n, p.cache_ns, traceparent, p.constraint)
        branches = [_Branch(IncrementalDetokenizer(self.text.tokenizer, p.input_ids, p.skip_special_tokens, p.stop))
                    for _ in range(p.n)]
        live = p.n
        try:
            async for out in self.client.stream(queue):
                b = branches[out.index]
                if b.done:
                    continue
                if out.finish == "error":
                    live = 0
                    raise BY_WIRE_CODE.get(out.error_code, Internal)(out.error)
                b.generated += len(out.token_ids)
                b.cached = max(b.cached, out.cached_tokens)
                text = b.detok.push(out.token_ids)
                lps = _logprobs(out)
                if not (b.detok.stopped or out.finish):
                    yield Chunk(out.index, out.token_ids, text, logprobs=lps)
                    continue
                b.done, live = True, live - 1
                usage = Usage(len(p.input_ids), b.generated, b.cached)
                if b.detok.stopped:
                    if not out.finish:
                        self.client.abort(rid, "stop", out.index)
                    yield Chunk(out.index, out.token_ids, text, "stop", usage, matched_stop=b.detok.matched_stop,
                                logprobs=lps)
                else:
                    last = out.token_ids[-1] if out.token_ids else None
                    stop_id = last if out.finish == "stop" and last in p.params.stop_token_ids else None
                    yield Chunk(out.index, out.token_ids, text + b.detok.finish(), out.finish, usage,
                                matched_stop_token_id=stop_id, logprobs=lps)
                if live == 0:
                    stage("sent", rid, completion_tokens=sum(x.generated for x in branches))
                    return
        finally:
            self.client.release(rid)
            if live:  # the caller went away (cancel, deadline, disconnect): free its KV
                self.client.abort(rid)
                stage("cancelled", rid, completion_tokens=sum(x.generated for x in branches))
