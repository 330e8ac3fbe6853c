"""Sessions and pinned prefixes at the edge, for both fronts (gRPC ``OpenSession`` /
``CloseSession`` / ``PinPrefix`` / ``UnpinPrefix``, HTTP ``/v1/sessions``).

The scheduler keeps a session (its turns' token ids, their KV pinned: services/scheduler/
sessions.py); a replica keeps nothing, so any replica can serve any turn. A session lives in one
data-parallel group, the rendezvous hash of its id (``SchedulerClient.session_group``), the same
in every replica. Before a turn is tokenized its replica asks that group for the turn it
continues (``view``: its length, the room left), so that the new input is rendered as a
continuation and validated against the whole prompt.

A pin is a prompt-only request (``GenerateReq.pin``) in every group (requests may go to any), its
id ``pin-…``, its request in group g ``pin-…@g``; when one group refuses, the others are unpinned.
"""

from __future__ import annotations

import asyncio
import uuid

from shared.errors import Internal, InvalidArgument
from shared.messages.common import FinishReason, SamplingParams
from shared.messages.to_scheduler import GenerateReq, PinSpec, SessionOp, SessionOpKind, UnpinReq
from shared.messages.to_tokenizer import SessionView
from services.tokenizer import validation
from services.tokenizer.router import Route
from services.tokenizer.scheduler_client import SchedulerClient

DEFAULT_TTL_S = 600
MAX_TTL_S = 7 * 24 * 3600
MAX_PIN_ID = 256


def check_ttl(ttl: int | None, default: int, minimum: int, name: str = "ttl_seconds") -> int:
    if ttl is None:
        return default
    if not minimum <= ttl <= MAX_TTL_S:
        raise InvalidArgument(f"{name} must be in [{minimum}, {MAX_TTL_S}], got {ttl}")
    return ttl


class SessionFront:
    def __init__(self, client: SchedulerClient) -> None:
        self.client = client

    # ---- sessions ----------------------------------------------------------------------------
    async def open(self, ttl_seconds: int | None, capacity: int | None, cache_salt: str) -> SessionView:
        ttl = check_ttl(ttl_seconds, DEFAULT_TTL_S, 1)
        if capacity is not None and not 1 <= capacity < 2**31:
            raise InvalidArgument(f"capacity must be a positive number of tokens, got {capacity}")
        if len(cache_salt) > validation.MAX_CACHE_SALT:
            raise InvalidArgument(f"cache_salt is longer than {validation.MAX_CACHE_SALT} characters")
        sid = "sess-" + uuid.uuid4().hex
        reply = await self.client.calls.call(self.client.session_group(sid), lambda token: SessionOp(
            token=token, op=SessionOpKind.OPEN, session_id=sid, ttl_s=float(ttl), capacity=capacity or 0,
            cache_ns=cache_salt))
        return reply.session

    async def close(self, session_id: str) -> int:
        """→ the tokens it held pinned."""
        validation.check_session_id(session_id)
        reply = await self.client.calls.call(self.client.session_group(session_id), lambda token: SessionOp(
            token=token, op=SessionOpKind.CLOSE, session_id=session_id))
        return reply.tokens

    async def view(self, session_id: str, parent: str = "") -> SessionView:
        """The turn a new one continues (``parent``, or the latest) as the session's group sees it."""
        validation.check_session_id(session_id)
        if len(parent) > validation.MAX_REQUEST_ID:
            raise InvalidArgument(f"session_parent is longer than {validation.MAX_REQUEST_ID} characters")
        reply = await self.client.calls.call(self.client.session_group(session_id), lambda token: SessionOp(
            token=token, op=SessionOpKind.INFO, session_id=session_id, parent=parent))
        return reply.session

    # ---- pins --------------------------------------------------------------------------------
    async def pin(self, ids: list[int], ttl_seconds: int | None, cache_salt: str, traceparent: str = "") -> tuple[str, int]:
        """Prefill ``ids`` and pin them in every group. → (pin id, cached tokens: the fewest any
        group had already)."""
        ttl = check_ttl(ttl_seconds, 0, 0)
        if len(cache_salt) > validation.MAX_CACHE_SALT:
            raise InvalidArgument(f"cache_salt is longer than {validation.MAX_CACHE_SALT} characters")
        pin_id = "pin-" + uuid.uuid4().hex
        await self.client.watch.wait_serving()
        groups = list(range(len(self.client.links)))
        results = await asyncio.gather(*(self._pin_one(g, pin_id, ids, ttl, cache_salt, traceparent) for g in groups),
                                       return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            for g, r in zip(groups, results):
                if not isinstance(r, BaseException):
                    await self._unpin_one(g, pin_id, missing_ok=True)
            raise failed[0]
        return pin_id, min(results, default=0)

    async def _pin_one(self, g: int, pin_id: str, ids: list[int], ttl: int, ns: str, traceparent: str) -> int:
        rid = f"{pin_id}@{g}"
        params = SamplingParams(temperature=0.0, max_new_tokens=0)
        req = GenerateReq(rid=rid, input_ids=ids, params=params, cache_ns=ns, traceparent=traceparent,
                          pin=PinSpec(ttl_s=float(ttl)))
        # a caller gone: unpin it too, should it complete meanwhile (the scheduler takes the abort and
        # the unpin in order; the unpin's answer is dropped)
        out = await self.client.final(req, Route(g, 0, "pin"),
                                      lambda: self.client.links[g].q.send(UnpinReq(token="", pin_id=rid)))
        if out.finish is not FinishReason.LENGTH:
            raise Internal(f"pinning ended with {out.finish}")
        return out.cached_tokens

    async def unpin(self, pin_id: str) -> int:
        """→ the tokens it held pinned (in one group)."""
        if not 0 < len(pin_id) <= MAX_PIN_ID:
            raise InvalidArgument(f"pin_id must have 1..{MAX_PIN_ID} characters")
        found = await asyncio.gather(*(self._unpin_one(g, pin_id) for g in range(len(self.client.links))),
                                     return_exceptions=True)
        held = [x for x in found if not isinstance(x, BaseException)]
        if not held:  # (a group that restarted lost its pins: the others' answer counts)
            raise found[0]
        return max(held)

    async def _unpin_one(self, g: int, pin_id: str, missing_ok: bool = False) -> int:
        try:
            reply = await self.client.calls.call(g, lambda token: UnpinReq(token=token, pin_id=f"{pin_id}@{g}"))
        except BaseException:
            if missing_ok:
                return 0
            raise
        return reply.tokens

