"""Load probing of the scheduler groups: ``LoadReq`` → ``Load`` (GetLoad, and with several groups
a probe every ``probe_interval`` seconds that feeds the router the other replicas' load and notices
a group that stops answering for ``DOWN_AFTER_S``)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable

from shared.errors import Unavailable
from shared.messages.to_scheduler import LoadReq
from shared.messages.to_tokenizer import Load
from services.tokenizer.groups import GroupLink
from services.tokenizer.router import Router

DOWN_AFTER_S = 10.0  # a group that answers no load probe for this long is routed around


def total_load(loads: list[Load]) -> Load:
    """The sum of the groups' loads (counters and KV slots)."""
    fields = [f for f in Load.__struct_fields__ if f != "token"]
    return Load(token=loads[0].token, **{f: sum(getattr(x, f) for x in loads) for f in fields})


class LoadProbe:
    def __init__(self, links: list[GroupLink], router: Router, set_up: Callable[[int, bool], None]) -> None:
        self.links, self.router, self._set_up = links, router, set_up
        self._pending: dict[str, asyncio.Future[Load]] = {}

    def answered(self, msg: Load) -> None:
        """A group's ``Load`` arrived."""
        fut = self._pending.pop(msg.token, None)
        if fut is not None and not fut.done():
            fut.set_result(msg)

    async def of(self, g: int, timeout: float) -> Load:
        token = uuid.uuid4().hex
        fut: asyncio.Future[Load] = asyncio.get_running_loop().create_future()
        self._pending[token] = fut
        self.links[g].q.send(LoadReq(token=token))
        try:
            return await asyncio.wait_for(fut, timeout)
        except TimeoutError as e:
            which = "the scheduler" if len(self.links) == 1 else f"data-parallel group {g}"
            raise Unavailable(f"{which} did not answer") from e
        finally:
            self._pending.pop(token, None)

    async def all(self, timeout: float) -> list[Load]:
        """Each group's load, in group order."""
        return list(await asyncio.gather(*(self.of(g, timeout) for g in range(len(self.links)))))

    async def run(self, interval: float) -> None:
        """Probe every group that said hello, every ``interval`` seconds."""
        while True:
            await asyncio.sleep(interval)
            await asyncio.gather(*(self._one(g, interval) for g, link in enumerate(self.links)
                                   if link.info is not None))

    async def _one(self, g: int, interval: float) -> None:
        link, mine = self.links[g], self.router.groups[g].in_flight
        try:
            load = await self.of(g, max(interval, 1.0))
        except Unavailable:
            if link.up and time.monotonic() - link.answered > DOWN_AFTER_S:
                self._set_up(g, False)
            return
        link.answered = time.monotonic()
        self.router.observed(g, load.num_running + load.num_waiting, mine)
        if not link.up:
            self._set_up(g, True)
