"""The tokenizer replica's async link to the scheduler groups: one DEALER socket per group (one
group, or N with data parallelism), one reader task per socket that routes each ``TokenOut`` to
the stream waiting for it, and a ``Router`` that picks the group of each new request.

With several groups: the replica is ready once every group has sent its ``ModelInfo`` and they
agree on the model (they must: any group may answer any request); a probe task asks each group
for its ``Load`` every ``probe_interval`` seconds, which feeds the router the other replicas'
load and notices a group that stops answering (``DOWN_AFTER_S``): that group's requests in flight
end with UNAVAILABLE, new ones go to the other groups, and it is used again once it answers.
A group whose worker was lost says so (``EngineStatus``; its scheduler has failed its requests):
it is routed around the same way until its restarted worker is ready (``ModelInfo`` again).
A scheduler process that exits is noticed by ``SchedulerWatch`` (``scheduler_watch.py``), which
calls ``scheduler_lost`` / ``scheduler_back`` here.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import zmq.asyncio

from shared.config import ConfigError
from shared.errors import BY_WIRE_CODE, AlreadyExists, Internal, Unavailable
from shared.logging import get_logger, stage
from shared.messages.common import ErrorCode, FinishReason
from shared.messages.to_scheduler import AbortReq, GenerateReq, TokenizerHello
from shared.messages.to_tokenizer import EngineStatus, Load, ModelInfo, Reply, TokenOut, TokenOutBatch
from shared.tracing import trace_id
from services.tokenizer.calls import Calls
from services.tokenizer.groups import GroupLink, merge_info
from services.tokenizer.loads import DOWN_AFTER_S, LoadProbe, total_load
from services.tokenizer.merging import merged
from services.tokenizer.router import Route, Router, rendezvous
from services.tokenizer.scheduler_watch import SchedulerWatch

log = get_logger("tokenizer")
__all__ = ["SchedulerClient", "total_load"]


@dataclass
class _Flight:
    queue: asyncio.Queue[TokenOut]
    group: int
    n: int


class SchedulerClient:
    def __init__(self, endpoints: list[str] | str, identity: str, router: Router | None = None,
                 probe_interval: float = 1.0, gone_grace: float = 30.0, restart_wait: float = 60.0) -> None:
        if isinstance(endpoints, str):
            endpoints = [e.strip() for e in endpoints.split(",") if e.strip()]
        self.identity = identity
        self.ctx = zmq.asyncio.Context()
        self.links = [GroupLink(self.ctx, e, identity) for e in endpoints]
        self.router = router or Router(len(self.links))
        assert len(self.router.groups) == len(self.links)
        self.probe_interval = probe_interval if len(self.links) > 1 else 0.0
        self.info: ModelInfo | None = None
        self.ready = asyncio.Event()  # serving: every group said hello once, and one is up now
        self.on_health: Callable[[bool], None] | None = None  # called when ``ready`` changes later
        # other message types (KV events, flush answers) → handler(group, message); see services/tokenizer/smg
        self.listeners: dict[type, Callable[[int, Any], None]] = {}
        self._failed: ConfigError | None = None
        self._changed = asyncio.Event()
        self._streams: dict[str, _Flight] = {}
        self.probe = LoadProbe(self.links, self.router, self._set_up)
        self.calls = Calls(self.links)  # control calls: sessions, unpinning
        self._tasks: list[asyncio.Task] = []
        self.closing = False
        self.watch = SchedulerWatch(self, gone_grace, restart_wait)  # scheduler processes gone / back

    async def start(self) -> None:
        self._tasks = [asyncio.create_task(self._read(g)) for g in range(len(self.links))] + self.watch.start()
        if self.probe_interval > 0:
            self._tasks.append(asyncio.create_task(self.probe.run(self.probe_interval)))
        for link in self.links:
            link.q.send(TokenizerHello(replica=self.identity))

    async def wait_ready(self) -> None:
        """Until every group is ready; raises ``ConfigError`` when the groups disagree."""
        while not self.ready.is_set() and self._failed is None:
            self._changed.clear()
            await self._changed.wait()
        if self._failed is not None:
            raise self._failed

    async def _read(self, g: int) -> None:
        link = self.links[g]
        while True:
            msg = await link.q.recv()
            if isinstance(msg, TokenOutBatch):
                for out in msg.outs:
                    flight = self._streams.get(out.rid)
                    if flight is not None and flight.group == g:
                        flight.queue.put_nowait(out)
            elif isinstance(msg, Load):
                self.probe.answered(msg)
            elif isinstance(msg, Reply):
                self.calls.answered(msg)
            elif isinstance(msg, ModelInfo):
                link.info, link.answered = msg, time.monotonic()
                self.router.set_pool(g, msg.pool_size)
                log.info("scheduler_ready", group=g, model=msg.model, context_length=msg.context_length,
                         pool_size=msg.pool_size)
                self._all_ready()
                if link.down:  # its restarted worker is ready
                    self._engine(g, "")
            elif isinstance(msg, EngineStatus) and not msg.serving:  # its worker was lost: it is restarted
                self.watch.restarting_now(g, msg.reason or "the engine stopped serving")
                self._engine(g, msg.reason or "the engine stopped serving")
            elif type(msg) in self.listeners:
                self.listeners[type(msg)](g, msg)

    def _all_ready(self) -> None:
        infos = [link.info for link in self.links]
        if self.info is not None or any(i is None for i in infos):
            return
        try:
            self.info = merge_info(infos)
        except ConfigError as e:
            self._failed = e
            log.error("scheduler_groups_disagree", error=str(e))
        else:
            self.ready.set()
        self._changed.set()

    # ---- requests ------------------------------------------------------------------------------
    def model_info(self) -> ModelInfo:
        """The served model (every group's merged), or UNAVAILABLE before the engine is up."""
        if self.info is None:
            raise Unavailable("the model is not loaded yet")
        return self.info

    def in_flight(self, rid: str) -> bool:
        return rid in self._streams

    @property
    def streams_open(self) -> int:
        return len(self._streams)

    def route(self, input_ids: list[int], cache_ns: str = "") -> Route:
        """The group for a prompt (remembered as having its prefix from now on)."""
        try:
            return self.router.route(input_ids, cache_ns)
        except LookupError as e:
            raise Unavailable("no data-parallel group is answering") from e

    def session_group(self, session_id: str) -> int:
        """The group that holds a session: the same in every replica (rendezvous hash of its id)."""
        key = int.from_bytes(hashlib.blake2b(session_id.encode(), digest_size=8).digest(), "little", signed=True)
        return rendezvous(key, list(range(len(self.links))))[0]

    def submit(self, req: GenerateReq, route: Route | None = None) -> asyncio.Queue[TokenOut]:
        """Send a request to ``route``'s group (default: its session's group, else the router's
        choice); returns the queue its outputs arrive on. Call ``release`` when done."""
        rid = req.rid
        if self.info is None or self.closing:
            raise Unavailable("the engine is not ready" if self.info is None else "the engine is shutting down")
        downs = [link.down for link in self.links if link.down]
        if downs and not self.ready.is_set():  # (no group serves: say why)
            raise Unavailable("the engine is not serving: " + "; ".join(dict.fromkeys(downs)))
        if rid in self._streams:
            raise AlreadyExists(f"request_id {rid!r} is already in flight")
        if route is None and req.session is not None:
            route = Route(self.session_group(req.session.session_id), 0, "session")
        route = route or self.route(req.input_ids, req.cache_ns)
        if not self.links[route.group].usable:
            link = self.links[route.group]
            raise Unavailable(f"data-parallel group {route.group} is not serving: {link.down or 'not answering'}")
        queue: asyncio.Queue[TokenOut] = asyncio.Queue()
        self._streams[rid] = _Flight(queue, route.group, req.n)
        self.router.started(route.group, req.n)
        stage("routed", rid, trace_id=trace_id(req.traceparent), group=route.group, reason=route.reason,
              matched_tokens=route.matched_tokens)
        self.links[route.group].q.send(req)
        return queue

    def abort(self, rid: str, reason: FinishReason = FinishReason.ABORT, index: int = -1,
              output_tokens: int = -1) -> None:
        """Stop a request (``index`` ≥ 0: one branch of an n > 1 request; ``output_tokens``: a stop
        string ended it after that many tokens). A request no longer in flight here (released
        already) is aborted in every group: the one holding it stops it."""
        flight = self._streams.get(rid)
        msg = AbortReq(rid=rid, reason=reason, index=index, output_tokens=output_tokens)
        for g in [flight.group] if flight is not None else range(len(self.links)):
            self.links[g].q.send(msg)

    def release(self, rid: str) -> None:
        flight = self._streams.pop(rid, None)
        if flight is not None:
            self.router.ended(flight.group, flight.n)

    @staticmethod
    def stream(queue: asyncio.Queue[TokenOut]) -> AsyncIterator[TokenOut]:
        """Outputs of all branches as they come (a branch's queued-up outputs merged into one:
        ``merging.py``); the caller stops when every branch is done."""
        return merged(queue)

    async def final(self, req: GenerateReq, route: Route | None = None,
                    abandoned: Callable[[], None] | None = None) -> TokenOut:
        """Run a request that streams nothing the caller wants (no output tokens: a pin, a scoring
        pass) to its end → its last output; an error ends it with its wire code's exception. A caller
        that goes away first aborts it (and calls ``abandoned``)."""
        queue, done = self.submit(req, route), False
        try:
            async for out in self.stream(queue):
                if out.finish is not None:
                    done = True
                    if out.finish is FinishReason.ERROR:
                        raise BY_WIRE_CODE.get(out.error_code, Internal)(out.error)
                    return out
        finally:
            if not done:
                self.abort(req.rid)
                if abandoned is not None:
                    abandoned()
            self.release(req.rid)
        raise Internal(f"the stream of {req.rid} ended early")

    # ---- load ----------------------------------------------------------------------------------
    async def loads(self, timeout: float = 5.0) -> list[Load]:
        """Each group's load, in group order."""
        return await self.probe.all(timeout)

    async def load(self, timeout: float = 5.0) -> Load:
        """The load of all groups together."""
        return total_load(await self.probe.all(timeout))

    # ---- groups up / down ----------------------------------------------------------------------
    def _engine(self, g: int, down: str) -> None:
        """Group ``g``'s engine stopped serving (``down``: why) or serves again ("")."""
        link = self.links[g]
        link.down = down
        if down:
            log.error("engine_not_serving", group=g, reason=down)
        else:
            log.warning("engine_serving", group=g)
        self.router.set_up(g, link.usable)
        self._health()

    def _set_up(self, g: int, up: bool) -> None:
        link = self.links[g]
        link.up = up
        self.router.set_up(g, link.usable)
        if up:
            log.warning("group_up", group=g, endpoint=link.endpoint)
        else:
            log.error("group_down", group=g, endpoint=link.endpoint, seconds=DOWN_AFTER_S)
            self._end_streams(g, f"data-parallel group {g} stopped answering")
        self._health()

    def _end_streams(self, g: int, error: str) -> None:
        """End group ``g``'s requests in flight with UNAVAILABLE: the client may retry, and another
        group (or the group, back) will take it."""
        for rid, flight in list(self._streams.items()):
            if flight.group == g:
                self.links[g].q.send(AbortReq(rid=rid))
                for i in range(flight.n):
                    flight.queue.put_nowait(TokenOut(rid=rid, index=i, finish=FinishReason.ERROR,
                                                     error_code=ErrorCode.UNAVAILABLE, error=error))

    def scheduler_lost(self, g: int, reason: str) -> None:
        """Group ``g``'s scheduler process is gone: its requests in flight end now, and it is routed
        around until it serves again (``ModelInfo`` from a restarted one)."""
        self._end_streams(g, f"{reason}: the request was lost, retry it")
        self._engine(g, reason)

    def scheduler_back(self, g: int) -> None:
        """Group ``g``'s connection is open again (a restarted scheduler): say hello, so it answers
        with ``ModelInfo`` once its worker is ready."""
        self.links[g].q.send(TokenizerHello(replica=self.identity))

    def _health(self) -> None:
        serving = any(link.usable for link in self.links)
        if serving != self.ready.is_set() and self.info is not None:
            (self.ready.set if serving else self.ready.clear)()
            if self.on_health is not None:
                self.on_health(serving)

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        self.watch.close()
        for link in self.links:
            link.q.close()
        self.ctx.term()
