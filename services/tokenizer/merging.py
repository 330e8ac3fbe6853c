"""One request's outputs as the replica reads them: the outputs of one branch that queued up
while the replica was busy (a slow client, a busy process) come as one — one message to write
instead of one per step, so a replica that falls behind catches up instead of falling further
behind. Never merged past a finish or an error."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from shared.messages.common import FinishReason
from shared.messages.to_tokenizer import TokenOut


def merge_outputs(a: TokenOut, b: TokenOut) -> TokenOut:
    """Two consecutive outputs of one branch as one (``b`` after ``a``; ``b`` may be the last)."""
    return TokenOut(rid=a.rid, index=a.index, token_ids=a.token_ids + b.token_ids, finish=b.finish, error=b.error,
                    error_code=b.error_code, prompt_tokens=b.prompt_tokens or a.prompt_tokens,
                    cached_tokens=max(a.cached_tokens, b.cached_tokens),
                    completion_tokens=b.completion_tokens or a.completion_tokens, logprobs=a.logprobs + b.logprobs,
                    top_ids=a.top_ids + b.top_ids, top_logprobs=a.top_logprobs + b.top_logprobs,
                    prompt_logprobs=a.prompt_logprobs + b.prompt_logprobs,
                    prompt_top_ids=a.prompt_top_ids + b.prompt_top_ids,
                    prompt_top_logprobs=a.prompt_top_logprobs + b.prompt_top_logprobs)


async def merged(queue: asyncio.Queue[TokenOut]) -> AsyncIterator[TokenOut]:
    """Outputs of all branches as they come; the caller stops when every branch is done."""
    held: TokenOut | None = None
    while True:
        out = held if held is not None else await queue.get()
        held = None
        while not out.finish and not queue.empty():
            nxt = queue.get_nowait()
            if nxt.index != out.index or nxt.finish is FinishReason.ERROR:
                held = nxt
                break
            out = merge_outputs(out, nxt)
        yield out
