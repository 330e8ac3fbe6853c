"""``SubscribeKvEvents``: the schedulers' KV-cache block events, relayed to gRPC subscribers.

While at least one gRPC subscriber listens, the replica subscribes to every scheduler group
(``KvSubscribe``, renewed every ``RENEW_S``; the scheduler publishes nothing to nobody, so an
idle service costs nothing). A group answers with a snapshot of its cache, then one ``KvEvents``
per scheduler step that changed it. The relay keeps the union of the groups' blocks: a block is
stored for the subscribers when the first group caches it and removed when the last one drops it,
so a gateway sees one worker — this replica — whose cache is what any of its groups holds.

Each gRPC stream starts with a snapshot of that union (``KvCacheCleared``, then every block,
parents first, in ``KvSnapshotChunk``-marked batches), then gets every change; its batches are
numbered from ``start_sequence_number + 1`` on, consecutively, so a gateway resuming at its last
sequence never takes the new stream for a stale one (there is no replay: the snapshot resyncs
it). A subscriber that falls ``MAX_QUEUED`` batches behind is cut off (it reconnects and gets a
fresh snapshot).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from smg_grpc_proto.generated import common_pb2 as pb

from shared.errors import Unavailable
from shared.logging import get_logger
from shared.messages.to_scheduler import KvSubscribe
from shared.messages.to_tokenizer import KvCleared, KvEvents, KvRemoved, KvStored
from services.tokenizer.scheduler_client import SchedulerClient

log = get_logger("tokenizer")
RENEW_S = 2.0  # KvSubscribe renewal period (the scheduler's lease is KV_LEASE_S)
MAX_QUEUED = 4096  # batches a subscriber may fall behind
SYNC_WAIT_S = 3.0  # a first subscriber waits this long at most for every group's snapshot
SNAPSHOT_BLOCKS = 4096  # blocks per snapshot batch


class _Block:
    __slots__ = ("count", "parent", "tokens", "ns", "depth")

    def __init__(self, parent: int | None, tokens: list[int], ns: str, depth: int) -> None:
        self.count = 0  # groups holding it
        self.parent, self.tokens, self.ns, self.depth = parent, tokens, ns, depth


_BEHIND, _CLOSED = "behind", "closed"  # markers that end a stream


class _Stream:
    def __init__(self, start: int) -> None:
        self.seq = start
        self.queue: asyncio.Queue[pb.KvEventBatch | str] = asyncio.Queue()

    def put(self, batch: pb.KvEventBatch | str) -> None:
        self.queue.put_nowait(_BEHIND if self.queue.qsize() >= MAX_QUEUED and batch is not _CLOSED else batch)


def _stored(blocks: list[tuple[int, _Block]], parent: int | None) -> pb.KvCacheEvent:
    ev = pb.KvBlocksStored(blocks=[pb.KvBlock(block_hash=h, token_ids=b.tokens, block_size=len(b.tokens))
                                   for h, b in blocks], tier=pb.KV_CACHE_TIER_DEVICE, medium="GPU",
                           locality=pb.KV_CACHE_LOCALITY_LOCAL)
    if parent is not None:
        ev.parent_block_hash = parent
    if blocks[0][1].ns:
        ev.cache_salt = blocks[0][1].ns
    return pb.KvCacheEvent(stored=ev)


class KvRelay:
    def __init__(self, client: SchedulerClient) -> None:
        self.client = client
        self.blocks: dict[int, _Block] = {}  # the union: hash → block
        self.held: list[set[int]] = [set() for _ in client.links]  # per group: the hashes it holds
        self.streams: set[_Stream] = set()
        self.users = 0  # subscribers, also those still waiting for the first snapshot
        self.synced = [False for _ in client.links]  # the group's snapshot arrived since subscribing
        self._all_synced = asyncio.Event()
        self._renew: asyncio.Task | None = None
        client.listeners[KvEvents] = self._on_events

    # ---- subscribers ---------------------------------------------------------------------------
    async def subscribe(self, start_seq: int = 0) -> AsyncIterator[pb.KvEventBatch]:
        stream = _Stream(start_seq)
        if not self.users:
            self._start()
        self.users += 1
        try:
            if not self._all_synced.is_set():  # (a group that does not answer is left out of the first snapshot)
                try:
                    await asyncio.wait_for(self._all_synced.wait(), SYNC_WAIT_S)
                except TimeoutError:
                    log.warning("kv_events_not_synced", groups=[g for g, ok in enumerate(self.synced) if not ok])
            self.streams.add(stream)  # (from here on it gets every change after the snapshot)
            for batch in self._snapshot():
                stream.put(batch)
            while True:
                batch = await stream.queue.get()
                if batch is _CLOSED:
                    return
                if batch is _BEHIND:
                    raise Unavailable(f"KV event subscriber fell {MAX_QUEUED} batches behind: resubscribe")
                stream.seq += 1
                batch.sequence_number = stream.seq
                yield batch
        finally:
            self.streams.discard(stream)
            self.users -= 1
            if not self.users:
                self._stop()

    def _start(self) -> None:
        self._renew = asyncio.get_running_loop().create_task(self._renewing())

    def _stop(self) -> None:
        if self._renew is not None:
            self._renew.cancel()
            self._renew = None
        for link in self.client.links:
            link.q.send(KvSubscribe(on=False))
        self.blocks.clear()
        self.held = [set() for _ in self.client.links]
        self.synced = [False for _ in self.client.links]
        self._all_synced.clear()

    async def _renewing(self) -> None:
        while True:
            for link in self.client.links:
                link.q.send(KvSubscribe(on=True))
            await asyncio.sleep(RENEW_S)

    def _snapshot(self) -> list[pb.KvEventBatch]:
        """The union now: cleared, then every block (parents before children)."""
        order = sorted(self.blocks.items(), key=lambda kv: kv[1].depth)
        parts = [order[i:i + SNAPSHOT_BLOCKS] for i in range(0, len(order), SNAPSHOT_BLOCKS)] or [[]]
        now, out = time.time(), []
        for i, part in enumerate(parts):
            events = [pb.KvCacheEvent(cleared=pb.KvCacheCleared())] if i == 0 else []
            events += [_stored([(h, b)], b.parent) for h, b in part]
            out.append(pb.KvEventBatch(timestamp=now, events=events, snapshot=pb.KvSnapshotChunk(
                index=i, count=len(parts), blocks=len(order))))
        return out

    def _publish(self, events: list[pb.KvCacheEvent], ts: float) -> None:
        if events:
            for s in self.streams:
                s.put(pb.KvEventBatch(timestamp=ts, events=events))

    # ---- from the schedulers -------------------------------------------------------------------
    def _on_events(self, g: int, msg: KvEvents) -> None:
        if not self.users:
            return  # (in flight when the last subscriber left)
        out: list[pb.KvCacheEvent] = []
        if msg.snapshot:  # replaces what this group held: only the difference goes out
            keep = {h for ev in msg.events if isinstance(ev, KvStored) for h in ev.hashes}
            self._drop(g, self.held[g] - keep, out)
            self.synced[g] = True
            if all(self.synced):
                self._all_synced.set()
        for ev in msg.events:
            if isinstance(ev, KvStored):
                self._add(g, ev, out)
            elif isinstance(ev, KvRemoved):
                self._drop(g, ev.hashes, out)
            elif isinstance(ev, KvCleared) and not msg.snapshot:
                self._drop(g, set(self.held[g]), out)
        self._publish(out, msg.ts)

    def _add(self, g: int, ev: KvStored, out: list[pb.KvCacheEvent]) -> None:
        held, parent = self.held[g], ev.parent
        run: list[tuple[int, _Block]] = []  # blocks new to the union, consecutive
        run_parent = parent
        bs = ev.block_size
        for i, h in enumerate(ev.hashes):
            b = self.blocks.get(h)
            if b is None:
                up = self.blocks.get(parent) if parent is not None else None
                b = self.blocks[h] = _Block(parent, ev.tokens[i * bs:(i + 1) * bs], ev.ns, up.depth + 1 if up else 0)
            if h not in held:
                held.add(h)
                b.count += 1
                if b.count == 1:
                    if not run:
                        run_parent = parent
                    run.append((h, b))
                    parent = h
                    continue
            if run:
                out.append(_stored(run, run_parent))
                run = []
            parent = h
        if run:
            out.append(_stored(run, run_parent))

    def _drop(self, g: int, hashes, out: list[pb.KvCacheEvent]) -> None:
        held, gone = self.held[g], []
        deep_first = sorted(hashes, key=lambda h: -self.blocks[h].depth if h in self.blocks else 0)
        for h in deep_first:
            if h not in held:
                continue
            held.discard(h)
            b = self.blocks[h]
            b.count -= 1
            if b.count == 0:
                del self.blocks[h]
                gone.append(h)
        if gone:
            out.append(pb.KvCacheEvent(removed=pb.KvBlocksRemoved(block_hashes=gone, tier=pb.KV_CACHE_TIER_DEVICE,
                                                                 medium="GPU", locality=pb.KV_CACHE_LOCALITY_LOCAL)))

    def close(self) -> None:
        """End every stream (shutdown)."""
        for s in list(self.streams):
            s.put(_CLOSED)
