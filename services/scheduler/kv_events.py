"""KV-cache events: which blocks of token ids the scheduler's prefix cache holds, as they enter and
leave it, for prefix-aware fleet routers (the Shepherd Model Gateway's cache-aware policy through
the tokenizers' ``SubscribeKvEvents``; llm-d / Dynamo-style consumers on a ZMQ PUB socket).

**Blocks.** A block is ``block_size`` consecutive token ids of a cached path, aligned from the
start of the sequence (``--kv-events-block-size``, a multiple of the page size; default the
smallest multiple ≥ 16). A block is *stored* once the cache holds the whole path up to its end
and *removed* when any of it leaves (eviction, a flush). Its id chains everything before it, as
SGLang names its pages: ``d_k = SHA-256(d_{k-1} ‖ tokens_k as uint32 little-endian)`` (``d_-1``
absent, or, in a cache namespace (``cache_salt``), ``SHA-256("banyan-ns:" + ns)``), published as
the signed 64-bit integer of its first 8 bytes (big-endian; unsigned on the ZMQ socket). Consumers
key prefixes on the token ids (SMG hashes each block's tokens itself) and chain blocks by these ids.

**Who listens.** The cache reports token ranges to this module only while someone listens
(``PrefixCache.listener`` is None otherwise: nothing is computed per step): a tokenizer replica
that sent ``KvSubscribe`` within ``KV_LEASE_S`` (it first gets a snapshot: every block the cache
holds), or the PUB socket when ``--kv-events-endpoint`` is set. Events of one scheduler step go
out together (``flush``): one ``KvEvents`` per subscribed replica, one multipart message on the
socket (``[topic, sequence number (8 bytes, big-endian), msgpack batch]`` in vLLM's / SGLang's
``KVEventBatch`` layout: ``[ts, [["BlockStored", hashes, parent, token_ids, block_size, lora_id,
medium] | ["BlockRemoved", hashes, medium] | ["AllBlocksCleared"], …]]``).
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

import msgspec
import numpy as np
import zmq

from shared.logging import get_logger
from shared.messages.to_scheduler import KV_LEASE_S
from shared.messages.to_tokenizer import FlushCacheDone, KvCleared, KvEvents, KvRemoved, KvStored
from services.scheduler.cache import PrefixCache

log = get_logger("scheduler")
DEFAULT_BLOCK = 16
MEMO = 4096  # chain digests remembered (the end of each path hashed), so a path is hashed once
U64 = (1 << 64) - 1


def block_size_for(page_size: int, configured: int = 0) -> int:
    """The events' block size: ``configured``, else the smallest multiple of the page size ≥ 16."""
    return configured or page_size * -(-DEFAULT_BLOCK // page_size)


def ns_seed(ns: str) -> bytes | None:
    return hashlib.sha256(b"banyan-ns:" + ns.encode()).digest() if ns else None


def block_id(digest: bytes) -> int:
    """The published id: the digest's first 8 bytes, big-endian, as a signed 64-bit integer."""
    return int.from_bytes(digest[:8], "big", signed=True)


def chain(tokens: Sequence[int], block_size: int, prior: bytes | None, first: int = 0) -> list[bytes]:
    """Digests of the full blocks of ``tokens`` from block ``first`` on (``prior``: the digest of
    block ``first - 1``, or the namespace's seed when ``first`` is 0)."""
    buf = np.asarray(tokens[first * block_size:len(tokens) - len(tokens) % block_size], dtype="<u4").tobytes()
    out, step = [], 4 * block_size
    d = prior
    for i in range(0, len(buf), step):
        d = hashlib.sha256(d + buf[i:i + step] if d else buf[i:i + step]).digest()
        out.append(d)
    return out


class KvEventPublisher:
    """Implements ``CacheListener`` for the scheduler's prefix cache; see the module docstring."""

    def __init__(self, page_size: int, send: Callable[[bytes, KvEvents], None], block_size: int = 0,
                 endpoint: str = "", topic: str = "", ctx: zmq.Context | None = None) -> None:
        self.block_size = block_size_for(page_size, block_size)
        assert self.block_size % page_size == 0, "the block size must be a multiple of the page size"
        self._send = send
        self.subscribers: dict[bytes, float] = {}  # replica → lease end (monotonic)
        self.pending: list[KvStored | KvRemoved | KvCleared] = []
        self.seq = 0
        self.cache: PrefixCache | None = None
        # (ns, blocks, hash of their tokens) → the digest of the last: where chains were left (Python's
        # tuple hash is not salted: a collision, 1 in 2^64, would misname a block, never crash)
        self._memo: OrderedDict[tuple[str, int, int], bytes] = OrderedDict()
        self._pub: zmq.Socket | None = None
        self.endpoint = ""
        self._topic = topic.encode()
        self._enc = msgspec.msgpack.Encoder()
        if endpoint:
            self._pub = (ctx or zmq.Context.instance()).socket(zmq.PUB)
            self._pub.setsockopt(zmq.LINGER, 0)
            self._pub.bind(endpoint)
            self.endpoint = self._pub.getsockopt(zmq.LAST_ENDPOINT).decode()  # (a wildcard port resolved)
            log.info("kv_events_publishing", endpoint=self.endpoint, block_size=self.block_size, topic=topic)

    @property
    def listening(self) -> bool:
        return bool(self.subscribers) or self._pub is not None

    # ---- the cache comes and goes (with the worker) --------------------------------------------
    def attach(self, cache: PrefixCache) -> None:
        self.cache = cache
        self._listen()

    def detach(self) -> None:
        """The cache is gone (its KV died with the worker): everything left it."""
        if self.cache is not None and self.listening:
            self.pending.append(KvCleared())
        self.cache = None
        self._memo.clear()

    def _listen(self) -> None:
        if self.cache is not None:
            self.cache.listener = self if self.listening else None
        if not self.listening:
            self.pending.clear()
            self._memo.clear()

    # ---- subscriptions -------------------------------------------------------------------------
    def subscribe(self, replica: bytes, on: bool, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if not on:
            self.subscribers.pop(replica, None)
        elif replica in self.subscribers:
            self.subscribers[replica] = now + KV_LEASE_S
        else:
            self.flush(now)  # (this step's events: the others' — the snapshot has their effect)
            self.subscribers[replica] = now + KV_LEASE_S
            self._send(replica, KvEvents(seq=self.seq, ts=time.time(), events=self.snapshot(), snapshot=True))
            log.info("kv_events_subscribed", replica=replica.decode(errors="replace"), block_size=self.block_size)
        self._listen()

    def snapshot(self) -> list[KvStored | KvRemoved | KvCleared]:
        """Everything cached now: cleared, then every block, parents first."""
        events: list[KvStored | KvRemoved | KvCleared] = [KvCleared()]
        path: list[int] = []
        if self.cache is not None:
            for ns, start, edge in self.cache.walk():
                del path[start:]
                path += edge
                self.stored(ns, path, start, len(path), events)
        return events

    # ---- CacheListener -------------------------------------------------------------------------
    def stored(self, ns: str, key: Sequence[int], start: int, end: int, into: list | None = None) -> None:
        bs = self.block_size
        first, last = start // bs, end // bs  # blocks [first, last) were completed by [start, end)
        if first >= last:
            return
        digests = self._chain(ns, key, max(first - 1, 0), last)  # (with the parent's, when there is one)
        parent = block_id(digests.pop(0)) if first else None
        (self.pending if into is None else into).append(KvStored(
            hashes=[block_id(d) for d in digests], parent=parent, tokens=list(key[first * bs:last * bs]),
            block_size=bs, ns=ns))

    def removed(self, ns: str, key: Sequence[int], start: int, end: int) -> None:
        bs = self.block_size
        first, last = start // bs, end // bs  # blocks ending in (start, end] lost their end
        if first < last:
            self.pending.append(KvRemoved(hashes=[block_id(d) for d in reversed(self._chain(ns, key, first, last))]))

    def _chain(self, ns: str, key: Sequence[int], first: int, last: int) -> list[bytes]:
        """Digests of blocks [first, last) of ``key``; the chain up to ``first`` comes from the
        memo of where earlier chains ended (a prefix is hashed once, then looked up)."""
        bs = self.block_size
        prior = ns_seed(ns)
        if first:
            head = (ns, first, hash(tuple(key[:first * bs])))
            prior = self._memo.get(head)
            if prior is None:
                prior = chain(key[:first * bs], bs, ns_seed(ns))[-1]
                self._remember(head, prior)
        out = chain(key[:last * bs], bs, prior, first)
        self._remember((ns, last, hash(tuple(key[:last * bs]))), out[-1])
        return out

    def _remember(self, at: tuple[str, int, int], digest: bytes) -> None:
        self._memo[at] = digest
        if len(self._memo) > MEMO:
            self._memo.popitem(last=False)

    # ---- once per step -------------------------------------------------------------------------
    def flush(self, now: float | None = None) -> None:
        """Send this step's events to every subscriber; end the subscriptions not renewed."""
        if not self.subscribers and not self.pending:
            return
        now = time.monotonic() if now is None else now
        expired = [r for r, until in self.subscribers.items() if until < now]
        for r in expired:
            del self.subscribers[r]
            log.info("kv_events_unsubscribed", replica=r.decode(errors="replace"), reason="lease expired")
        if expired:
            self._listen()
        if not self.pending:
            return
        events, self.pending = self.pending, []
        self.seq += 1
        batch = KvEvents(seq=self.seq, ts=time.time(), events=events)
        for r in self.subscribers:
            self._send(r, batch)
        if self._pub is not None:
            self._pub.send_multipart([self._topic, self.seq.to_bytes(8, "big"), self._enc.encode(vllm_batch(batch))],
                                     copy=False)

    def close(self) -> None:
        if self._pub is not None:
            self._pub.close(linger=0)


def flush_cache(token: str, busy: int, cache: PrefixCache | None) -> FlushCacheDone:
    """SMG's FlushCache: drop every cached prefix, only while no request is in flight (``busy``)."""
    if cache is None:
        return FlushCacheDone(token=token, ok=False, message="not serving (no worker attached)")
    if busy:
        return FlushCacheDone(token=token, ok=False, message=f"{busy} request branches in flight")
    freed = cache.flush()
    return FlushCacheDone(token=token, ok=True, message=f"flushed {freed} cached tokens")


def vllm_batch(batch: KvEvents) -> list:
    """``batch`` in vLLM's / SGLang's ``KVEventBatch`` msgpack layout (block ids unsigned)."""
    out = []
    for ev in batch.events:
        if isinstance(ev, KvStored):
            parent = ev.parent & U64 if ev.parent is not None else None
            out.append(["BlockStored", [h & U64 for h in ev.hashes], parent, ev.tokens, ev.block_size, None, "GPU"])
        elif isinstance(ev, KvRemoved):
            out.append(["BlockRemoved", [h & U64 for h in ev.hashes], "GPU"])
        else:
            out.append(["AllBlocksCleared"])
    return [batch.ts, out]
