"""Flushing the prefix cache of every data-parallel group (SMG's ``FlushCache``, SGLang's
``POST /flush_cache``): one ``FlushCacheReq`` per group, its ``FlushCacheDone`` matched by token.
A group with requests in flight refuses; ``timeout_s`` > 0 waits up to that long for them to end."""

from __future__ import annotations

import asyncio
import time
import uuid
import weakref

from shared.errors import InvalidArgument
from shared.messages.to_scheduler import FlushCacheReq
from shared.messages.to_tokenizer import FlushCacheDone
from services.tokenizer.scheduler_client import SchedulerClient

POLL_S = 0.05
ANSWER_S = 10.0


_BY_CLIENT: weakref.WeakKeyDictionary[SchedulerClient, Flusher] = weakref.WeakKeyDictionary()


class Flusher:
    """One per scheduler client (``for_client``): it owns the client's ``FlushCacheDone`` listener."""

    def __init__(self, client: SchedulerClient) -> None:
        self.client = client
        self._waiting: dict[str, asyncio.Future[FlushCacheDone]] = {}
        client.listeners[FlushCacheDone] = self._done

    @classmethod
    def for_client(cls, client: SchedulerClient) -> Flusher:
        if client not in _BY_CLIENT:
            _BY_CLIENT[client] = cls(client)
        return _BY_CLIENT[client]

    async def flush(self, timeout_s: float = 0.0) -> tuple[bool, str]:
        """(every group flushed, the groups' messages)."""
        if not timeout_s >= 0:
            raise InvalidArgument(f"timeout_s must be >= 0, got {timeout_s}")
        self.client.model_info()  # (UNAVAILABLE before the engine is up)
        deadline = time.monotonic() + timeout_s
        while True:
            answers = await asyncio.gather(*(self._one(g) for g in range(len(self.client.links))))
            ok = all(a.ok for a in answers)
            if ok or time.monotonic() >= deadline:
                message = "; ".join(f"group {g}: {a.message}" if len(answers) > 1 else a.message
                                    for g, a in enumerate(answers) if a.message)
                return ok, message or "flushed"
            await asyncio.sleep(POLL_S)

    async def _one(self, g: int) -> FlushCacheDone:
        token = uuid.uuid4().hex
        fut: asyncio.Future[FlushCacheDone] = asyncio.get_running_loop().create_future()
        self._waiting[token] = fut
        self.client.links[g].q.send(FlushCacheReq(token=token))
        try:
            return await asyncio.wait_for(fut, ANSWER_S)
        except TimeoutError:
            return FlushCacheDone(token=token, ok=False, message=f"group {g} did not answer")
        finally:
            self._waiting.pop(token, None)

    def _done(self, g: int, msg: FlushCacheDone) -> None:
        fut = self._waiting.pop(msg.token, None)
        if fut is not None and not fut.done():
            fut.set_result(msg)
