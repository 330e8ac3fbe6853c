"""Control calls to a scheduler group (sessions, unpinning): a message carrying a fresh token goes
down, the ``Reply`` with the same token comes back; an error in it raises the matching
``BanyanError`` (NOT_FOUND, FAILED_PRECONDITION, RESOURCE_EXHAUSTED …)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable

from shared.errors import BY_WIRE_CODE, Internal, Unavailable
from shared.messages.to_tokenizer import Reply
from services.tokenizer.groups import GroupLink


class Calls:
    def __init__(self, links: list[GroupLink]) -> None:
        self.links = links
        self._pending: dict[str, asyncio.Future[Reply]] = {}

    def answered(self, msg: Reply) -> None:
        fut = self._pending.pop(msg.token, None)
        if fut is not None and not fut.done():
            fut.set_result(msg)

    async def call(self, g: int, make: Callable[[str], object], timeout: float = 10.0) -> Reply:
        """Send ``make(token)`` to group ``g`` and wait for its ``Reply``."""
        link = self.links[g]
        if not link.usable:
            raise Unavailable(f"the scheduler is not serving: {link.down or 'not answering'}")
        token = uuid.uuid4().hex
        fut: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        self._pending[token] = fut
        link.q.send(make(token))
        try:
            reply = await asyncio.wait_for(fut, timeout)
        except TimeoutError as e:
            raise Unavailable("the scheduler did not answer") from e
        finally:
            self._pending.pop(token, None)
        if reply.error_code is not None:
            raise BY_WIRE_CODE.get(reply.error_code, Internal)(reply.error)
        return reply
