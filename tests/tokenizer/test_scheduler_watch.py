"""The replica's watch over its scheduler connections, against a stand-in scheduler (a ROUTER on a
real ipc socket) that is closed and bound again as a killed and restarted scheduler would be:
streams in flight end with UNAVAILABLE at once, health follows, the replica says hello to the new
scheduler, a new request waits for the group (a restarting scheduler or worker) instead of failing, and a replica whose every
scheduler stays gone past the grace asks to exit."""

from __future__ import annotations

import asyncio

import zmq
import zmq.asyncio

from shared.messages.codec import Codec
from shared.messages.common import SamplingParams
from shared.messages.to_scheduler import GenerateReq, ToScheduler, TokenizerHello
from shared.messages.to_tokenizer import EngineStatus, ModelInfo, ToTokenizer, TokenOut, TokenOutBatch
from services.tokenizer.scheduler_client import SchedulerClient

WAIT_S = 30.0  # bound on waits for something that must happen (not a timing claim)
INFO = ModelInfo(model="m", architecture="A", vocab_size=100, context_length=512, pool_size=1000,
                 max_running_requests=8, eos_token_ids=[1], device="cpu", dtype="float32")
RECV, SEND = Codec(ToScheduler), Codec(ToTokenizer)


async def next_of(sock: zmq.asyncio.Socket, kind: type) -> tuple[bytes, object]:
    """The next message of ``kind`` the stand-in scheduler receives (others are skipped)."""
    while True:
        ident, frame = await asyncio.wait_for(sock.recv_multipart(), WAIT_S)
        msg = RECV.decode(frame)
        if isinstance(msg, kind):
            return ident, msg


async def first_out(queue: asyncio.Queue) -> TokenOut:
    return await asyncio.wait_for(queue.get(), WAIT_S)


def test_scheduler_gone_and_back(tmp_path):
    ep = f"ipc://{tmp_path}/s.ipc"
    health: list[bool] = []
    gone: list[bool] = []

    async def main() -> None:
        ctx = zmq.asyncio.Context()
        sched = ctx.socket(zmq.ROUTER)
        sched.bind(ep)
        client = SchedulerClient(ep, "tok", gone_grace=0.5, restart_wait=WAIT_S)
        client.watch.on_gone = lambda: gone.append(True)
        await client.start()
        try:
            ident, _ = await next_of(sched, TokenizerHello)
            await sched.send_multipart([ident, SEND.encode(INFO)])
            await asyncio.wait_for(client.wait_ready(), WAIT_S)
            client.on_health = health.append
            queue = client.submit(GenerateReq(rid="a", input_ids=[1, 2], params=SamplingParams()))
            await next_of(sched, GenerateReq)
            await sched.send_multipart([ident, SEND.encode(TokenOutBatch([TokenOut(rid="a", token_ids=[7])]))])
            assert (await first_out(queue)).token_ids == [7]

            sched.close(linger=0)  # the scheduler process dies: its connection closes
            out = await first_out(queue)  # the stream ends now, without any message
            assert out.finish == "error" and out.error_code == "unavailable", out
            assert "the scheduler exited" in out.error and "retry" in out.error
            client.release("a")
            assert health == [False] and not client.ready.is_set()

            waiting = asyncio.create_task(client.watch.wait_serving())  # a new request waits for the group
            await asyncio.sleep(0.2)
            assert not waiting.done()

            sched = ctx.socket(zmq.ROUTER)  # restarted: binds the same endpoint; the replica reconnects
            sched.bind(ep)
            ident, _ = await next_of(sched, TokenizerHello)  # and says hello to the new scheduler
            assert not waiting.done()  # not serving until its worker is ready
            await sched.send_multipart([ident, SEND.encode(INFO)])
            await asyncio.wait_for(waiting, WAIT_S)
            assert client.ready.is_set() and health == [False, True]
            client.submit(GenerateReq(rid="b", input_ids=[1, 2], params=SamplingParams()))
            assert (await next_of(sched, GenerateReq))[1].rid == "b"
            client.release("b")
            # its worker lost later: a restart too (the launcher restarts it), waited for the same way
            await sched.send_multipart([ident, SEND.encode(EngineStatus(serving=False, reason="the worker died"))])
            for _ in range(int(WAIT_S * 100)):
                if not client.ready.is_set():
                    break
                await asyncio.sleep(0.01)
            assert client.watch.restarting == [0]
            waiting = asyncio.create_task(client.watch.wait_serving())
            await asyncio.sleep(0.2)
            assert not waiting.done()
            await sched.send_multipart([ident, SEND.encode(INFO)])
            await asyncio.wait_for(waiting, WAIT_S)
            assert client.ready.is_set() and client.watch.restarting == []

            assert not gone
            sched.close(linger=0)  # gone again, and this time for good
            for _ in range(int(WAIT_S * 20)):
                if gone:
                    break
                await asyncio.sleep(0.05)
            assert gone == [True] and client.watch.all_gone_for() > 0.5
        finally:
            await client.close()
            sched.close(linger=0)
            ctx.term()

    asyncio.run(main())


def test_a_worker_loss_is_waited_for(tmp_path):
    """A group down because its worker was lost (``EngineStatus``) is restarting: a new request
    waits for its ``ModelInfo`` (bounded by restart_wait) instead of being refused at once, and is
    sent once it serves."""
    ep = f"ipc://{tmp_path}/s.ipc"

    async def main() -> None:
        ctx = zmq.asyncio.Context()
        sched = ctx.socket(zmq.ROUTER)
        sched.bind(ep)
        client = SchedulerClient(ep, "tok", restart_wait=WAIT_S)
        await client.start()
        try:
            ident, _ = await next_of(sched, TokenizerHello)
            await sched.send_multipart([ident, SEND.encode(INFO)])
            await asyncio.wait_for(client.wait_ready(), WAIT_S)
            await sched.send_multipart([ident, SEND.encode(EngineStatus(serving=False, reason="the worker died"))])
            for _ in range(int(WAIT_S * 100)):
                if not client.ready.is_set():
                    break
                await asyncio.sleep(0.01)
            assert not client.ready.is_set()
            waiting = asyncio.create_task(client.watch.wait_serving())
            await asyncio.sleep(0.2)
            assert not waiting.done()  # waits for the restarted worker …
            await sched.send_multipart([ident, SEND.encode(INFO)])
            await asyncio.wait_for(waiting, WAIT_S)  # … and goes on once it serves
            client.submit(GenerateReq(rid="c", input_ids=[1, 2], params=SamplingParams()))
            assert (await next_of(sched, GenerateReq))[1].rid == "c"
            client.release("c")
        finally:
            await client.close()
            sched.close(linger=0)
            ctx.term()

    asyncio.run(main())
