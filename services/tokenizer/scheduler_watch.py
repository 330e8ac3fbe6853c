"""The replica's watch over its scheduler connections (one per data-parallel group), from each
DEALER socket's ZMQ monitor events, so a scheduler process that exits is noticed at once, without
any message:

- **A scheduler gone** (its connection closed: killed, crashed, stopped): the group's streams in
  flight end with UNAVAILABLE now ("… exited: the request was lost, retry it"; HTTP 503 or an SSE
  error event), and the group is routed around — health NOT_SERVING when no group serves — until
  it serves again. Its KV and queue died with it, so nothing of it is waited for.
- **A scheduler back** (the connection is open again: a restarted scheduler bound the same
  endpoint; the DEALER reconnects by itself): the replica says hello again, so the new scheduler
  sends ``ModelInfo`` once its worker is ready, and the group serves again.
- **New requests** arriving while no group serves and one is restarting (its scheduler gone, or
  its worker lost: ``EngineStatus``; not serving since) wait for it, up to ``restart_wait`` seconds
  (or their deadline), instead of failing: a restart is expected to come back (``banyan serve``
  restarts both; under compose their restart policy does).
- **Every scheduler gone** for ``gone_grace`` seconds: the replica cannot serve, so it exits
  (``on_gone``, code 1) rather than hold the public ports as a husk; its launcher, if it has one,
  restarts it — when the launcher itself died, the parent-death signal took the replica already.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import zmq
from zmq.utils.monitor import parse_monitor_message

from shared.logging import get_logger



class _Client(Protocol):  # what of ``scheduler_client.SchedulerClient`` this uses (it owns the watch)
    links: Sequence
    ready: asyncio.Event
    info: object

    def scheduler_lost(self, g: int, reason: str) -> None: ...

    def scheduler_back(self, g: int) -> None: ...


log = get_logger("tokenizer")
EVENTS = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED


class SchedulerWatch:
    def __init__(self, client: _Client, gone_grace: float = 30.0, restart_wait: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.client = client
        self.gone_grace, self.restart_wait, self.clock = gone_grace, restart_wait, clock
        self.on_gone: Callable[[], None] | None = None  # every scheduler gone for gone_grace
        self.gone_since: dict[int, float] = {}  # groups whose connection is closed now → since when
        self.lost: dict[int, str] = {}  # group → the reason it was marked down with when its scheduler went
        self._monitors: list[zmq.Socket] = []

    def start(self) -> list[asyncio.Task]:
        """Monitor every link's socket (one task each) and, with a grace, the grace."""
        tasks = []
        for g, link in enumerate(self.client.links):
            mon = link.q.sock.get_monitor_socket(EVENTS)
            self._monitors.append(mon)
            tasks.append(asyncio.create_task(self._watch(g, mon)))
        if self.gone_grace > 0:
            tasks.append(asyncio.create_task(self._grace()))
        return tasks

    def what(self, g: int) -> str:
        return "the scheduler" if len(self.client.links) == 1 else f"the scheduler of data-parallel group {g}"

    async def _watch(self, g: int, mon: zmq.Socket) -> None:
        while True:
            event = parse_monitor_message(await mon.recv_multipart())["event"]
            self.on_event(g, event)

    def on_event(self, g: int, event: int) -> None:
        if event == zmq.EVENT_DISCONNECTED and g not in self.gone_since:
            self.gone_since[g] = self.clock()
            reason = self.lost[g] = f"{self.what(g)} exited (its connection closed)"
            log.error("scheduler_gone", group=g, endpoint=self.client.links[g].endpoint)
            self.client.scheduler_lost(g, reason)
        elif event == zmq.EVENT_CONNECTED and g in self.gone_since:
            down_s = self.clock() - self.gone_since.pop(g)
            log.warning("scheduler_reconnected", group=g, down_s=round(down_s, 3))
            self.client.scheduler_back(g)

    def all_gone_for(self) -> float:
        """Seconds since the last scheduler connection closed, when every one is closed now; else 0."""
        if len(self.gone_since) < len(self.client.links):
            return 0.0
        return self.clock() - max(self.gone_since.values())

    async def _grace(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.gone_grace / 4))
            if self.all_gone_for() > self.gone_grace:
                log.error("schedulers_gone", seconds=self.gone_grace, groups=len(self.client.links))
                if self.on_gone is not None:
                    self.on_gone()
                return

    def restarting_now(self, g: int, reason: str) -> None:
        """Group ``g`` is down for ``reason`` and coming back (its worker was lost and is restarted)."""
        self.lost[g] = reason

    @property
    def restarting(self) -> list[int]:
        """Groups whose scheduler went or whose worker was lost, and that have not served since (down
        for that reason still: a ``ModelInfo`` clears it)."""
        return [g for g, why in self.lost.items() if self.client.links[g].down == why]

    async def wait_serving(self) -> None:
        """Before a new request: when no group serves and one is restarting, wait for one to serve
        (at most ``restart_wait`` s); the request then goes on (and is refused, if still nothing serves)."""
        client = self.client
        if client.ready.is_set() or self.restart_wait <= 0 or client.info is None or not self.restarting:
            return
        try:
            await asyncio.wait_for(client.ready.wait(), self.restart_wait)
        except TimeoutError:
            pass

    def close(self) -> None:
        for mon in self._monitors:
            mon.close(linger=0)
        self._monitors.clear()
