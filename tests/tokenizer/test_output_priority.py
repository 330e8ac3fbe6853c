"""A batch of outputs from the scheduler wakes its streams' handlers by priority when prioritized
streams are in flight (an urgent token is not handled after a step's ~256 background ones), in
the batch's order otherwise; against a stand-in scheduler on a real ipc socket."""

from __future__ import annotations

import asyncio

import zmq
import zmq.asyncio

from shared.messages.common import SamplingParams
from shared.messages.to_scheduler import GenerateReq, TokenizerHello
from shared.messages.to_tokenizer import TokenOut, TokenOutBatch
from services.tokenizer.scheduler_client import SchedulerClient
from tests.tokenizer.test_scheduler_watch import INFO, SEND, WAIT_S, next_of


def _wake_order(tmp_path, priorities: dict[str, int], batch: list[str]) -> tuple[list[str], int]:
    ep = f"ipc://{tmp_path}/s.ipc"

    async def main() -> tuple[list[str], int]:
        ctx = zmq.asyncio.Context()
        sched = ctx.socket(zmq.ROUTER)
        sched.bind(ep)
        client = SchedulerClient(ep, "tok")
        await client.start()
        try:
            ident, _ = await next_of(sched, TokenizerHello)
            await sched.send_multipart([ident, SEND.encode(INFO)])
            await asyncio.wait_for(client.wait_ready(), WAIT_S)
            woke: list[str] = []

            async def handler(rid: str, queue: asyncio.Queue) -> None:
                await queue.get()
                woke.append(rid)

            tasks = []
            for rid, prio in priorities.items():
                queue = client.submit(GenerateReq(rid=rid, input_ids=[1, 2], params=SamplingParams(), priority=prio))
                tasks.append(asyncio.create_task(handler(rid, queue)))
                await next_of(sched, GenerateReq)
            outs = [TokenOut(rid=rid, token_ids=[7]) for rid in batch]
            await sched.send_multipart([ident, SEND.encode(TokenOutBatch(outs))])
            await asyncio.wait_for(asyncio.gather(*tasks), WAIT_S)
            for rid in priorities:
                client.release(rid)
            return woke, client._ranked
        finally:
            await client.close()
            sched.close(linger=0)
            ctx.term()

    return asyncio.run(main())


def test_urgent_outputs_wake_first(tmp_path):
    woke, ranked = _wake_order(tmp_path, {"bg1": 0, "bg2": 0, "mid": 5, "urgent": 10, "bg3": 0},
                               ["bg1", "bg2", "mid", "urgent", "bg3"])
    assert woke == ["urgent", "mid", "bg1", "bg2", "bg3"]
    assert ranked == 0  # (released: nothing prioritized in flight any more)


def test_batch_order_without_priorities(tmp_path):
    woke, ranked = _wake_order(tmp_path, {"a": 0, "b": 0, "c": 0}, ["c", "a", "b"])
    assert woke == ["c", "a", "b"] and ranked == 0
