"""A tokenizer replica that falls behind gets one branch's queued outputs as one (fewer messages
to write); nothing is lost, reordered across branches, or merged past a finish or an error."""

from __future__ import annotations

import asyncio

from services.tokenizer.scheduler_client import SchedulerClient
from shared.messages.common import ErrorCode, FinishReason
from shared.messages.to_tokenizer import TokenOut


def drain(outs: list[TokenOut], until: int) -> list[TokenOut]:
    """What ``stream`` yields when ``outs`` are all queued before the caller looks."""

    async def run() -> list[TokenOut]:
        q: asyncio.Queue[TokenOut] = asyncio.Queue()
        for o in outs:
            q.put_nowait(o)
        got = []
        async for o in SchedulerClient.stream(q):
            got.append(o)
            if len(got) == until:
                return got
        return got

    return asyncio.run(run())


def test_consecutive_outputs_of_a_branch_merge():
    outs = [TokenOut(rid="r", token_ids=[1], logprobs=[-0.1], top_ids=[[1, 2]], top_logprobs=[[-0.1, -2.0]],
                     cached_tokens=5),
            TokenOut(rid="r", token_ids=[2, 3], logprobs=[-0.2, -0.3], top_ids=[[2, 9], [3, 9]],
                     top_logprobs=[[-0.2, -3.0], [-0.3, -4.0]]),
            TokenOut(rid="r", token_ids=[4], logprobs=[-0.4], top_ids=[[4, 1]], top_logprobs=[[-0.4, -5.0]],
                     finish=FinishReason.LENGTH, prompt_tokens=7, completion_tokens=4)]
    (got,) = drain(outs, 1)
    assert got.token_ids == [1, 2, 3, 4] and got.logprobs == [-0.1, -0.2, -0.3, -0.4]
    assert got.top_ids == [[1, 2], [2, 9], [3, 9], [4, 1]] and len(got.top_logprobs) == 4
    assert (got.finish, got.prompt_tokens, got.completion_tokens, got.cached_tokens) == ("length", 7, 4, 5)


def test_branches_keep_their_order_and_a_finish_ends_a_merge():
    outs = [TokenOut(rid="r", index=0, token_ids=[1]), TokenOut(rid="r", index=0, token_ids=[2]),
            TokenOut(rid="r", index=1, token_ids=[3]),
            TokenOut(rid="r", index=0, token_ids=[4], finish=FinishReason.STOP),
            TokenOut(rid="r", index=0, token_ids=[5])]  # (after a finish: never merged into it)
    got = drain(outs, 4)
    assert [(o.index, o.token_ids, o.finish) for o in got] == [(0, [1, 2], None), (1, [3], None),
                                                                 (0, [4], FinishReason.STOP), (0, [5], None)]


def test_an_error_is_never_merged():
    outs = [TokenOut(rid="r", token_ids=[1]),
            TokenOut(rid="r", finish=FinishReason.ERROR, error="boom", error_code=ErrorCode.INTERNAL)]
    got = drain(outs, 2)
    assert [(o.token_ids, o.finish) for o in got] == [([1], None), ([], FinishReason.ERROR)]


def test_an_output_alone_comes_at_once():
    async def run() -> TokenOut:
        q: asyncio.Queue[TokenOut] = asyncio.Queue()
        q.put_nowait(TokenOut(rid="r", token_ids=[1]))
        it = SchedulerClient.stream(q)
        return await asyncio.wait_for(it.__anext__(), 5)  # does not wait for more

    assert asyncio.run(run()).token_ids == [1]
