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
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq.asyncio

from shared.config import ConfigError
from shared.errors import AlreadyExists, Unavailable
from shared.logging import get_logger, stage
from shared.messages.codec import Codec
from shared.messages.common import ErrorCode, FinishReason
from shared.messages.to_scheduler import AbortReq, GenerateReq, LoadReq, ToScheduler, TokenizerHello
from shared.messages.to_tokenizer import EngineStatus, Load, ModelInfo, ToTokenizer, TokenOut, TokenOutBatch
from shared.tracing import trace_id
from shared.transport import AsyncDealerQueue
from services.tokenizer.router import Route, Router

log = get_logger("tokenizer")
DOWN_AFTER_S = 10.0  # a group that answers no load probe for this long is routed around
AGREE = ("model", "architecture", "vocab_size", "context_length", "max_running_requests", "eos_token_ids", "dtype")


@dataclass
class _Flight:
    queue: asyncio.Queue[TokenOut]
    group: int
    n: int


class _Link:
    """One scheduler group."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, identity: str) -> None:
        self.endpoint = endpoint
        self.q: AsyncDealerQueue = AsyncDealerQueue(ctx, endpoint, Codec(ToTokenizer), Codec(ToScheduler),
                                                    identity=identity)
        self.info: ModelInfo | None = None
        self.answered = time.monotonic()  # when it last answered a load probe
        self.up = True
        self.down = ""  # why its engine is not serving (its worker was lost); "": serving

    @property
    def usable(self) -> bool:
        return self.up and not self.down


def merge_outputs(a: TokenOut, b: TokenOut) -> TokenOut:
    """Two consecutive outputs of one branch as one (``b`` after ``a``; ``b`` may be the last)."""
    return TokenOut(rid=a.rid, index=a.index, token_ids=a.token_ids + b.token_ids, finish=b.finish, error=b.error,
                    error_code=b.error_code, prompt_tokens=b.prompt_tokens or a.prompt_tokens,
                    cached_tokens=max(a.cached_tokens, b.cached_tokens),
                    completion_tokens=b.completion_tokens or a.completion_tokens, logprobs=a.logprobs + b.logprobs,
                    top_ids=a.top_ids + b.top_ids, top_logprobs=a.top_logprobs + b.top_logprobs,
                    prompt_logprobs=a.prompt_logprobs + b.prompt_logprobs)


def merge_info(infos: list[ModelInfo]) -> ModelInfo:
    """One ``ModelInfo`` for all groups: they must agree on the model and the per-request limits;
    the pool is the smallest (a request runs in one group); devices are listed once each."""
    first = infos[0]
    for g, i in enumerate(infos[1:], 1):
        diff = [f for f in AGREE if getattr(i, f) != getattr(first, f)]
        if diff:
            raise ConfigError(f"data-parallel group {g} differs from group 0 in {', '.join(diff)}: "
                              f"{[getattr(i, f) for f in diff]} != {[getattr(first, f) for f in diff]}")
    return msgspec.structs.replace(first, pool_size=min(i.pool_size for i in infos),
                                   device=",".join(dict.fromkeys(i.device for i in infos)))


def total_load(loads: list[Load]) -> Load:
    """The sum of the groups' loads (counters and KV slots)."""
    fields = [f for f in Load.__struct_fields__ if f != "token"]
    return Load(token=loads[0].token, **{f: sum(getattr(x, f) for x in loads) for f in fields})


class SchedulerClient:
    def __init__(self, endpoints: list[str] | str, identity: str, router: Router | None = None,
                 probe_interval: float = 1.0) -> None:
        if isinstance(endpoints, str):
            endpoints = [e.strip() for e in endpoints.split(",") if e.strip()]
        self.identity = identity
        self.ctx = zmq.asyncio.Context()
        self.links = [_Link(self.ctx, e, identity) for e in endpoints]
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
        self._loads: dict[str, asyncio.Future[Load]] = {}
        self._tasks: list[asyncio.Task] = []
        self.closing = False

    async def start(self) -> None:
        self._tasks = [asyncio.create_task(self._read(g)) for g in range(len(self.links))]
        if self.probe_interval > 0:
            self._tasks.append(asyncio.create_task(self._probe()))
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
                fut = self._loads.pop(msg.token, None)
                if fut is not None and not fut.done():
                    fut.set_result(msg)
            elif isinstance(msg, ModelInfo):
                link.info, link.answered = msg, time.monotonic()
                self.router.set_pool(g, msg.pool_size)
                log.info("scheduler_ready", group=g, model=msg.model, context_length=msg.context_length,
                         pool_size=msg.pool_size)
                self._all_ready()
                if link.down:  # its restarted worker is ready
                    self._engine(g, "")
            elif isinstance(msg, EngineStatus) and not msg.serving:
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
    def in_flight(self, rid: str) -> bool:
        return rid in self._streams

    def route(self, input_ids: list[int], cache_ns: str = "") -> Route:
        """The group for a prompt (remembered as having its prefix from now on)."""
        try:
            return self.router.route(input_ids, cache_ns)
        except LookupError as e:
            raise Unavailable("no data-parallel group is answering") from e

    def submit(self, req: GenerateReq, route: Route | None = None) -> asyncio.Queue[TokenOut]:
        """Send a request to ``route``'s group (default: the router's choice); returns the queue
        its outputs arrive on. Call ``release`` when done."""
        rid = req.rid
        if self.info is None or self.closing:
            raise Unavailable("the engine is not ready" if self.info is None else "the engine is shutting down")
        downs = [link.down for link in self.links if link.down]
        if downs and not self.ready.is_set():  # (no group serves: say why)
            raise Unavailable("the engine is not serving: " + "; ".join(dict.fromkeys(downs)))
        if rid in self._streams:
            raise AlreadyExists(f"request_id {rid!r} is already in flight")
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

    def abort(self, rid: str, reason: FinishReason = FinishReason.ABORT, index: int = -1) -> None:
        """Stop a request (``index`` ≥ 0: one branch of an n > 1 request). A request no longer in
        flight here (released already) is aborted in every group: the one holding it stops it."""
        flight = self._streams.get(rid)
        msg = AbortReq(rid=rid, reason=reason, index=index)
        for g in [flight.group] if flight is not None else range(len(self.links)):
            self.links[g].q.send(msg)

    def release(self, rid: str) -> None:
        flight = self._streams.pop(rid, None)
        if flight is not None:
            self.router.ended(flight.group, flight.n)

    @staticmethod
    async def stream(queue: asyncio.Queue[TokenOut]) -> AsyncIterator[TokenOut]:
        """Outputs of all branches as they come; the caller stops when every branch is done.
        Outputs of one branch that queued up behind each other while the caller was busy (a slow
        client, a busy process) come as one: one message to write instead of one per step, so a
        replica that falls behind catches up instead of falling further behind."""
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

    # ---- load ----------------------------------------------------------------------------------
    async def _load_of(self, g: int, timeout: float) -> Load:
        token = uuid.uuid4().hex
        fut: asyncio.Future[Load] = asyncio.get_running_loop().create_future()
        self._loads[token] = fut
        self.links[g].q.send(LoadReq(token=token))
        try:
            return await asyncio.wait_for(fut, timeout)
        except TimeoutError as e:
            which = "the scheduler" if len(self.links) == 1 else f"data-parallel group {g}"
            raise Unavailable(f"{which} did not answer") from e
        finally:
            self._loads.pop(token, None)

    async def loads(self, timeout: float = 5.0) -> list[Load]:
        """Each group's load, in group order."""
        return list(await asyncio.gather(*(self._load_of(g, timeout) for g in range(len(self.links)))))

    async def load(self, timeout: float = 5.0) -> Load:
        """The load of all groups together."""
        return total_load(await self.loads(timeout))

    async def _probe(self) -> None:
        while True:
            await asyncio.sleep(self.probe_interval)
            await asyncio.gather(*(self._probe_one(g) for g, link in enumerate(self.links) if link.info is not None))

    async def _probe_one(self, g: int) -> None:
        link, mine = self.links[g], self.router.groups[g].in_flight
        try:
            load = await self._load_of(g, max(self.probe_interval, 1.0))
        except Unavailable:
            if link.up and time.monotonic() - link.answered > DOWN_AFTER_S:
                self._set_up(g, False)
            return
        link.answered = time.monotonic()
        self.router.observed(g, load.num_running + load.num_waiting, mine)
        if not link.up:
            self._set_up(g, True)

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
            for rid, flight in list(self._streams.items()):
                if flight.group == g:  # end them: the client may retry, and another group will take it
                    link.q.send(AbortReq(rid=rid))
                    for i in range(flight.n):
                        flight.queue.put_nowait(TokenOut(rid=rid, index=i, finish=FinishReason.ERROR,
                                                         error_code=ErrorCode.UNAVAILABLE,
                                                         error=f"data-parallel group {g} stopped answering"))
        self._health()

    def _health(self) -> None:
        serving = any(link.usable for link in self.links)
        if serving != self.ready.is_set() and self.info is not None:
            (self.ready.set if serving else self.ready.clear)()
            if self.on_health is not None:
                self.on_health(serving)

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        for link in self.links:
            link.q.close()
        self.ctx.term()
