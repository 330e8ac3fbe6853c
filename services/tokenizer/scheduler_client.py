"""The tokenizer replica's async link to the scheduler: one DEALER socket, one reader task that
routes each ``TokenOut`` to the stream waiting for it."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import zmq.asyncio

from shared.errors import AlreadyExists, Unavailable
from shared.logging import get_logger
from shared.messages.codec import Codec
from shared.messages.common import Constraint, SamplingParams
from shared.messages.to_scheduler import AbortReq, GenerateReq, LoadReq, ToScheduler, TokenizerHello
from shared.messages.to_tokenizer import Load, ModelInfo, ToTokenizer, TokenOut, TokenOutBatch
from shared.transport import AsyncDealerQueue

log = get_logger("tokenizer")


class SchedulerClient:
    def __init__(self, endpoint: str, identity: str) -> None:
        self.identity = identity
        self.ctx = zmq.asyncio.Context()
        self.q: AsyncDealerQueue = AsyncDealerQueue(self.ctx, endpoint, Codec(ToTokenizer), Codec(ToScheduler),
                                                    identity=identity)
        self.info: ModelInfo | None = None
        self.ready = asyncio.Event()
        self._streams: dict[str, asyncio.Queue[TokenOut]] = {}
        self._loads: dict[str, asyncio.Future[Load]] = {}
        self._reader: asyncio.Task | None = None
        self.closing = False

    async def start(self) -> None:
        self._reader = asyncio.create_task(self._read())
        self.q.send(TokenizerHello(replica=self.identity))

    async def _read(self) -> None:
        while True:
            msg = await self.q.recv()
            if isinstance(msg, TokenOutBatch):
                for out in msg.outs:
                    stream = self._streams.get(out.rid)
                    if stream is not None:
                        stream.put_nowait(out)
            elif isinstance(msg, Load):
                fut = self._loads.pop(msg.token, None)
                if fut is not None and not fut.done():
                    fut.set_result(msg)
            elif isinstance(msg, ModelInfo):
                self.info = msg
                self.ready.set()
                log.info("scheduler_ready", model=msg.model, context_length=msg.context_length)

    def in_flight(self, rid: str) -> bool:
        return rid in self._streams

    def submit(self, rid: str, input_ids: list[int], params: SamplingParams, n: int = 1, cache_ns: str = "",
               traceparent: str = "", constraint: Constraint | None = None) -> asyncio.Queue[TokenOut]:
        """Send a request; returns the queue its outputs arrive on. Call ``release`` when done."""
        if self.info is None or self.closing:
            raise Unavailable("the engine is not ready" if self.info is None else "the engine is shutting down")
        if rid in self._streams:
            raise AlreadyExists(f"request_id {rid!r} is already in flight")
        queue: asyncio.Queue[TokenOut] = asyncio.Queue()
        self._streams[rid] = queue
        self.q.send(GenerateReq(rid=rid, input_ids=input_ids, params=params, n=n, cache_ns=cache_ns,
                                constraint=constraint, traceparent=traceparent))
        return queue

    def abort(self, rid: str, reason: str = "abort", index: int = -1) -> None:
        """Stop a request (``index`` ≥ 0: one branch of an n > 1 request)."""
        self.q.send(AbortReq(rid=rid, reason=reason, index=index))

    def release(self, rid: str) -> None:
        self._streams.pop(rid, None)

    async def load(self, timeout: float = 5.0) -> Load:
        token = uuid.uuid4().hex
        fut: asyncio.Future[Load] = asyncio.get_running_loop().create_future()
        self._loads[token] = fut
        self.q.send(LoadReq(token=token))
        try:
            return await asyncio.wait_for(fut, timeout)
        except TimeoutError as e:
            raise Unavailable("the scheduler did not answer") from e
        finally:
            self._loads.pop(token, None)

    async def stream(self, queue: asyncio.Queue[TokenOut]) -> AsyncIterator[TokenOut]:
        """Outputs of all branches as they come; the caller stops when every branch is done."""
        while True:
            yield await queue.get()

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        self.q.close()
        self.ctx.term()
