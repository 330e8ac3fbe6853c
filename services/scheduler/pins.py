"""Pinned prefixes (cache anchors, ``PinPrefix`` / ``UnpinPrefix``) and the budget of pinned KV that
they share with sessions (``sessions.py``).

A pin is a prompt-only request (``GenerateReq.pin``, ``max_new_tokens`` 0): it is queued and
prefilled like any request (a prefix already cached is reused), and when it completes its prompt
— now wholly in the prefix cache — is locked through the ``PrefixCache`` interface
(``KVManager.pin``): exempt from eviction until ``UnpinPrefix``, its TTL, or the worker's loss.

**Budget.** Everything pinned — pins and every session's tokens — counts against one cap,
``--max-pinned-tokens`` (default a quarter of the KV pool, at most half), so anchors never starve
serving. Work that may pin tokens reserves them when it is queued (a pin: its prompt; a session
turn: its input + max_tokens) and turns the reservation into what it really pinned when it ends:
``used + reserved`` never exceeds the cap. A request over it is refused with RESOURCE_EXHAUSTED.

A request's ``anchor`` (a ``PinAnchor`` here, a session's ``TurnAnchor``) is told when it ends
(``RequestTable.end``, after its KV went into the cache): that is the only hook into the loop.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from shared.messages.common import ErrorCode, FinishReason
from shared.messages.to_scheduler import GenerateReq
from services.scheduler.cache import CacheHandle
from services.scheduler.kv import KVManager
from services.scheduler.request import Req

Refusal = tuple[ErrorCode, str]
MAX_PINS = 4096
EXPIRY_CHECK_S = 0.25  # expiries are looked at this often (the loop asks every iteration)


@dataclass
class PinBudget:
    """Pinned KV tokens: ``used`` (held now), ``reserved`` (work in flight that may pin), ``limit``."""

    limit: int
    used: int = 0
    reserved: int = 0

    @property
    def room(self) -> int:
        return self.limit - self.used - self.reserved

    def refusal(self, tokens: int, what: str) -> Refusal | None:
        if tokens <= self.room:
            return None
        return ErrorCode.RESOURCE_EXHAUSTED, (
            f"{what} may pin {tokens} tokens, more than the pinned-token budget has left ({max(self.room, 0)} of "
            f"--max-pinned-tokens {self.limit}: {self.used} pinned, {self.reserved} reserved by requests in "
            "flight): close sessions or unpin prefixes, or retry later")


def budget_limit(configured: int, pool_size: int) -> int:
    """``--max-pinned-tokens`` (0: a quarter of the pool), never more than half the pool."""
    return min(configured or pool_size // 4, pool_size // 2)


@dataclass
class Pin:
    pin_id: str
    handle: CacheHandle
    tokens: int  # prompt tokens pinned (the budget counts these)
    cached: int  # of which the cache holds (whole pages)
    expires: float  # monotonic time (inf: until unpinned)


class PinAnchor:
    """The pin request's hook: its reservation becomes a pin when it completes."""

    def __init__(self, pins: Pins, size: int, ttl_s: float) -> None:
        self.pins, self.size, self.ttl_s = pins, size, ttl_s

    def ended(self, r: Req, reason: FinishReason, kv: KVManager | None) -> None:
        self.pins.budget.reserved -= self.size
        if reason is FinishReason.LENGTH and kv is not None:  # (a prompt-only request completes with LENGTH)
            self.pins.commit(r, self.size, self.ttl_s)


class Pins:
    def __init__(self, kv: KVManager, budget: PinBudget, clock: Callable[[], float] = time.monotonic) -> None:
        self.kv, self.budget, self.clock = kv, budget, clock
        self.pins: dict[str, Pin] = {}
        self._next_check = 0.0
        self.tokens = 0  # the pins' tokens together (read every step by the metrics)

    def begin(self, msg: GenerateReq) -> tuple[PinAnchor | None, Refusal | None]:
        """A ``PinPrefix`` request arrives: its anchor (tokens reserved), or why it is refused."""
        if not self.kv.caching:
            return None, (ErrorCode.FAILED_PRECONDITION,
                          "the prefix cache is off (--disable-radix-cache): nothing can be pinned")
        if msg.rid in self.pins:
            return None, (ErrorCode.ALREADY_EXISTS, f"pin {msg.rid!r} exists already")
        if len(self.pins) >= MAX_PINS:
            return None, (ErrorCode.RESOURCE_EXHAUSTED, f"{MAX_PINS} prefixes are pinned already: unpin some")
        size = len(msg.input_ids)
        err = self.budget.refusal(size, f"pinning this prefix ({size} tokens)")
        if err is not None:
            return None, err
        self.budget.reserved += size
        return PinAnchor(self, size, msg.pin.ttl_s if msg.pin is not None else 0.0), None

    def commit(self, r: Req, size: int, ttl_s: float) -> None:
        handle, cached = self.kv.pin(r.ns, r.prompt)
        expires = self.clock() + ttl_s if ttl_s > 0 else math.inf
        self.pins[r.rid] = Pin(r.rid, handle, size, cached, expires)
        self.budget.used += size
        self.tokens += size

    def unpin(self, pin_id: str) -> tuple[int, Refusal | None]:
        """→ (tokens it held, None), or (0, why not)."""
        pin = self.pins.pop(pin_id, None)
        if pin is None:
            return 0, (ErrorCode.NOT_FOUND, f"pin {pin_id!r} does not exist (never pinned, unpinned, expired, "
                                            "or lost when the worker restarted)")
        self.kv.unpin(pin.handle)
        self.budget.used -= pin.tokens
        self.tokens -= pin.tokens
        return pin.tokens, None

    def expire(self, now: float) -> None:
        if now < self._next_check:
            return
        self._next_check = now + EXPIRY_CHECK_S
        for pin_id in [p.pin_id for p in self.pins.values() if p.expires <= now]:
            self.unpin(pin_id)
