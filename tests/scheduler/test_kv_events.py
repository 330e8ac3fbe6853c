"""KV-cache events against the real radix cache: after any mix of inserts and evictions, the
blocks stored minus the blocks removed are exactly the cache's blocks (every full block of every
cached path), by ids computed here from the tokens independently; a fresh subscriber's snapshot
says the same; nothing is computed while nobody listens; the ZMQ socket carries vLLM's layout."""

from __future__ import annotations

import hashlib
import random
import time

import msgspec
import pytest
import zmq

from shared.messages.to_scheduler import KV_LEASE_S
from shared.messages.to_tokenizer import FlushCacheDone, KvCleared, KvEvents, KvRemoved, KvStored
from services.scheduler.cache import RadixCache
from services.scheduler.kv_events import KvEventPublisher, block_size_for, flush_cache


def expected_blocks(cache: RadixCache, bs: int) -> dict[int, tuple[int | None, tuple[int, ...]]]:
    """id → (parent id, tokens) of every full block of every cached path, hashed here."""
    out = {}
    for ns, root in cache._roots.items():
        stack = [(c, []) for c in root.children.values()]
        while stack:
            node, above = stack.pop()
            path = above + node.key
            d = hashlib.sha256(b"banyan-ns:" + ns.encode()).digest() if ns else b""
            parent = None
            for k in range(len(path) // bs):
                d = hashlib.sha256(d + b"".join(t.to_bytes(4, "little") for t in path[k * bs:(k + 1) * bs])).digest()
                h = int.from_bytes(d[:8], "big", signed=True)
                out[h] = (parent, tuple(path[k * bs:(k + 1) * bs]))
                parent = h
            stack.extend((c, path) for c in node.children.values())
    return out


class Mirror:
    """A subscriber's view, rebuilt from events only (and checked as it goes)."""

    def __init__(self) -> None:
        self.blocks: dict[int, tuple[int | None, tuple[int, ...]]] = {}

    def apply(self, events) -> None:
        for ev in events:
            if isinstance(ev, KvCleared):
                self.blocks.clear()
            elif isinstance(ev, KvStored):
                parent, bs = ev.parent, ev.block_size
                assert len(ev.tokens) == bs * len(ev.hashes)
                for i, h in enumerate(ev.hashes):
                    assert parent is None or parent in self.blocks, "a block before its parent"
                    assert h not in self.blocks, "stored twice"
                    self.blocks[h] = (parent, tuple(ev.tokens[i * bs:(i + 1) * bs]))
                    parent = h
            else:
                for h in ev.hashes:
                    assert not any(p == h for p, _ in self.blocks.values()), "a parent before its child"
                    del self.blocks[h]


@pytest.mark.parametrize("page, block, seed", [(1, 0, 0), (1, 4, 1), (4, 8, 2), (16, 16, 3)])
def test_stored_minus_removed_is_the_cache(page, block, seed):
    rng = random.Random(seed)
    sent: list[tuple[bytes, KvEvents]] = []
    free: list[int] = list(range(1, 4097))
    cache = RadixCache(lambda slots: free.extend(slots), page)
    pub = KvEventPublisher(page, lambda r, m: sent.append((r, m)), block)
    pub.attach(cache)
    bs = pub.block_size
    assert bs == block_size_for(page, block) and bs % page == 0 and bs >= min(block or 16, 16)
    assert cache.listener is None, "nobody listens: the cache reports nothing"
    families = [[rng.randrange(2000) for _ in range(rng.randrange(8, 80))] for _ in range(6)]

    def insert(ns: str) -> None:
        key = rng.choice(families)[:rng.randrange(1, 80)] + [rng.randrange(2000) for _ in range(rng.randrange(0, 40))]
        n = len(key) - len(key) % page
        if len(free) < n:
            return
        slots = [free.pop() for _ in range(n)]
        res = cache.insert(ns, key, slots)
        free.extend(slots[:res.cached])  # (duplicates stay the caller's)

    for _ in range(30):  # before anyone subscribes: cached, not reported
        insert("")
    assert not pub.pending
    pub.subscribe(b"replica-a", True, now=0.0)
    assert cache.listener is pub
    mirror = Mirror()
    (_, snap), = sent
    assert snap.snapshot and isinstance(snap.events[0], KvCleared)
    mirror.apply(snap.events)
    assert mirror.blocks == expected_blocks(cache, bs), "the snapshot is the cache"
    removals = peak = 0
    for step in range(300):  # steps of inserts and evictions, one batch each
        for _ in range(rng.randrange(1, 4)):
            insert(rng.choice(["", "", "", "tenant"]))
        if rng.random() < 0.5:
            cache.evict(rng.randrange(1, 200))
        sent.clear()
        pub.flush(now=1.0)
        for r, m in sent:
            assert r == b"replica-a" and not m.snapshot
            mirror.apply(m.events)
            removals += sum(len(e.hashes) for e in m.events if isinstance(e, KvRemoved))
        cache.check_integrity()
        peak = max(peak, len(mirror.blocks))
    assert mirror.blocks == expected_blocks(cache, bs)
    assert peak > 10 and removals > 10, (peak, removals)
    # a second replica's snapshot: the same, computed from the tree
    sent.clear()
    pub.subscribe(b"replica-b", True, now=1.0)
    fresh = Mirror()
    fresh.apply(sent[-1][1].events)
    assert sent[-1][0] == b"replica-b" and fresh.blocks == mirror.blocks
    # flushing the cache removes every block
    sent.clear()
    done = flush_cache("t", 0, cache)
    assert done == FlushCacheDone(token="t", ok=True, message=done.message) and cache.evictable_size == 0
    pub.flush(now=1.0)
    assert [r for r, _ in sent] == [b"replica-a", b"replica-b"] and sent[0][1] is sent[1][1]
    mirror.apply(sent[0][1].events)
    assert mirror.blocks == {}
    assert not flush_cache("t", 3, cache).ok and not flush_cache("t", 0, None).ok


def test_removals_are_reported():
    sent = []
    free = list(range(1, 257))
    cache = RadixCache(lambda slots: free.extend(slots), 1)
    pub = KvEventPublisher(1, lambda r, m: sent.append(m), 4)
    pub.attach(cache)
    pub.subscribe(b"r", True, now=0.0)
    key = list(range(100, 110))
    cache.insert("", key, [free.pop() for _ in key])
    cache.insert("", key[:6] + [7, 8, 9], [free.pop() for _ in range(9)])
    pub.flush(now=0.0)
    stored = [e for m in sent for e in m.events if isinstance(e, KvStored)]
    assert [len(e.hashes) for e in stored] == [2, 1]  # blocks 0-1 of the first path, block 1' of the second
    assert stored[1].parent == stored[0].hashes[0] and stored[1].tokens == key[4:6] + [7, 8]
    sent.clear()
    cache.evict(7)  # both leaves go (their shared upper node stays: it holds block 0)
    pub.flush(now=0.0)
    (batch,) = sent
    removed = [h for e in batch.events for h in e.hashes]
    assert sorted(removed) == sorted([stored[0].hashes[1], stored[1].hashes[0]])


def test_subscriptions_lease_and_cost_nothing_unsubscribed():
    sent = []
    cache = RadixCache(lambda slots: None, 1)
    pub = KvEventPublisher(1, lambda r, m: sent.append((r, m)))
    pub.attach(cache)
    pub.subscribe(b"r", True, now=0.0)
    pub.subscribe(b"r", True, now=5.0)  # a renewal: no second snapshot
    assert len(sent) == 1 and cache.listener is pub
    pub.flush(now=5.0 + KV_LEASE_S - 1)
    assert pub.subscribers
    pub.flush(now=5.0 + KV_LEASE_S + 1)  # not renewed: gone, and the cache stops reporting
    assert not pub.subscribers and cache.listener is None
    pub.subscribe(b"r", True, now=100.0)
    pub.subscribe(b"r", False, now=101.0)
    assert cache.listener is None
    cache.insert("", [1] * 40, list(range(1, 41)))
    pub.flush(now=102.0)
    assert len(sent) == 2 and not pub.pending
    pub.subscribe(b"r", True, now=103.0)
    pub.detach()  # the worker was lost: the cache is gone, all blocks with it
    pub.flush(now=103.0)
    assert isinstance(sent[-1][1].events[-1], KvCleared) and pub.cache is None


def test_the_zmq_socket_carries_vllms_layout():
    ctx = zmq.Context()
    cache = RadixCache(lambda slots: None, 1)
    pub = KvEventPublisher(1, lambda r, m: None, 2, "tcp://127.0.0.1:*", "kv@pod@model", ctx)
    pub.attach(cache)
    assert cache.listener is pub, "a socket listens always"
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pub.endpoint)
    time.sleep(0.3)  # (ZMQ's slow joiner)
    cache.insert("", [5, 6, 7, 8, 9], list(range(1, 6)))
    cache.evict(5)
    pub.flush()
    assert sub.poll(5000)
    topic, seq, payload = sub.recv_multipart()
    assert topic == b"kv@pod@model" and int.from_bytes(seq, "big") == 1
    ts, events = msgspec.msgpack.decode(payload)
    stored, removed = events
    assert stored[0] == "BlockStored" and stored[2] is None and stored[3] == [5, 6, 7, 8] and stored[4] == 2
    assert all(0 <= h < 2**64 for h in stored[1]) and len(stored[1]) == 2 and stored[6] == "GPU"
    assert removed[0] == "BlockRemoved" and sorted(removed[1]) == sorted(stored[1]) and ts > 0
    pub.close()
    sub.close()
    ctx.term()
