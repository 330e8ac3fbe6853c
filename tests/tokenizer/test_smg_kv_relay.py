"""The KV-event relay of a tokenizer replica, against stand-in scheduler links: subscribing to the
groups only while someone listens, the snapshot a new stream starts with, the union of the groups
(a block is stored when the first group caches it, removed when the last drops it), sequence
numbers, a subscriber that falls behind."""

from __future__ import annotations

import asyncio

import pytest
from smg_grpc_proto.generated import common_pb2 as pb

from shared.errors import Unavailable
from shared.messages.to_scheduler import KvSubscribe
from shared.messages.to_tokenizer import KvCleared, KvEvents, KvRemoved, KvStored
from services.tokenizer.smg import kv_relay
from services.tokenizer.smg.kv_relay import KvRelay


class _Queue:
    def __init__(self) -> None:
        self.sent: list = []

    def send(self, msg) -> None:
        self.sent.append(msg)


class _Link:
    def __init__(self) -> None:
        self.q = _Queue()


class FakeClient:
    def __init__(self, groups: int) -> None:
        self.links = [_Link() for _ in range(groups)]
        self.listeners: dict = {}

    def deliver(self, g: int, *events, snapshot: bool = False) -> None:
        self.listeners[KvEvents](g, KvEvents(seq=0, ts=1.0, events=list(events), snapshot=snapshot))


def stored(hashes, parent=None, bs=2, ns=""):
    return KvStored(hashes=hashes, parent=parent, tokens=[h * 10 + i for h in hashes for i in range(bs)],
                    block_size=bs, ns=ns)


class Mirror:
    """What a gateway reconstructs from the stream: block → (parent, tokens)."""

    def __init__(self) -> None:
        self.blocks: dict[int, tuple[int | None, list[int]]] = {}
        self.seqs: list[int] = []

    def apply(self, batch: pb.KvEventBatch) -> None:
        self.seqs.append(batch.sequence_number)
        for ev in batch.events:
            kind = ev.WhichOneof("data")
            if kind == "cleared":
                self.blocks.clear()
            elif kind == "stored":
                parent = ev.stored.parent_block_hash if ev.stored.HasField("parent_block_hash") else None
                for b in ev.stored.blocks:
                    assert parent is None or parent in self.blocks, "a child before its parent"
                    self.blocks[b.block_hash] = (parent, list(b.token_ids))
                    parent = b.block_hash
            elif kind == "removed":
                for h in ev.removed.block_hashes:
                    assert all(p != h for p, _ in self.blocks.values()), "a parent before its child"
                    del self.blocks[h]


async def take(it, mirror: Mirror, n: int) -> None:
    for _ in range(n):
        mirror.apply(await asyncio.wait_for(it.__anext__(), 5))


def test_union_of_groups_snapshot_and_sequence(monkeypatch):
    monkeypatch.setattr(kv_relay, "SYNC_WAIT_S", 0.05)  # (the groups here send their snapshots later)

    async def main():
        client = FakeClient(2)
        relay = KvRelay(client)
        assert not any(link.q.sent for link in client.links), "nobody listens: nothing is asked of the schedulers"
        client.deliver(0, stored([1, 2]))  # before any subscriber: ignored
        first, m1 = relay.subscribe(start_seq=41), Mirror()
        await take(first, m1, 1)  # the (empty) snapshot
        assert m1.seqs == [42] and m1.blocks == {}
        assert all(link.q.sent == [KvSubscribe(on=True)] for link in client.links)
        # group 0's snapshot, then group 1 caches a prefix group 0 has and extends it
        client.deliver(0, KvCleared(), stored([1, 2]), stored([3], parent=2), snapshot=True)
        client.deliver(1, stored([1, 2, 4]))
        await take(first, m1, 2)
        assert m1.blocks == {1: (None, [10, 11]), 2: (1, [20, 21]), 3: (2, [30, 31]), 4: (2, [40, 41])}
        # group 0 drops 3 and 2 (children first): 2 stays, group 1 holds it; 3 goes
        client.deliver(0, KvRemoved([3, 2]))
        await take(first, m1, 1)
        assert set(m1.blocks) == {1, 2, 4}
        # a second subscriber starts from a snapshot of the union, parents first
        second, m2 = relay.subscribe(), Mirror()
        await take(second, m2, 1)
        assert m2.blocks == m1.blocks and m2.seqs == [1]
        # group 1's worker was lost: its blocks go, except what group 0 still holds (1)
        client.deliver(1, KvCleared())
        await take(first, m1, 1)
        await take(second, m2, 1)
        assert set(m1.blocks) == set(m2.blocks) == {1}
        assert m1.seqs == [42, 43, 44, 45, 46] and m2.seqs == [1, 2], "consecutive per stream"
        # a group's fresh snapshot (its scheduler restarted) replaces what it held: only the difference goes out
        client.deliver(0, KvCleared(), stored([1, 5]), snapshot=True)
        await take(first, m1, 1)
        assert set(m1.blocks) == {1, 5}
        await first.aclose()
        assert not any(isinstance(m, KvSubscribe) and not m.on for link in client.links for m in link.q.sent)
        await second.aclose()
        assert all(link.q.sent[-1] == KvSubscribe(on=False) for link in client.links), "the last one left"
        assert relay.blocks == {} and relay.held == [set(), set()]

    asyncio.run(main())


def test_the_first_snapshot_waits_for_every_group():
    async def main():
        client = FakeClient(2)
        relay = KvRelay(client)
        it, m = relay.subscribe(), Mirror()
        first = asyncio.ensure_future(it.__anext__())
        await asyncio.sleep(0.05)
        assert not first.done()
        client.deliver(0, KvCleared(), stored([1, 2]), snapshot=True)
        await asyncio.sleep(0.05)
        assert not first.done(), "group 1 has not answered yet"
        client.deliver(1, KvCleared(), stored([1, 7]), snapshot=True)
        m.apply(await asyncio.wait_for(first, 5))
        assert set(m.blocks) == {1, 2, 7} and m.seqs == [1]
        await it.aclose()

    asyncio.run(main())


def test_a_subscriber_that_falls_behind_is_cut_off(monkeypatch):
    monkeypatch.setattr(kv_relay, "MAX_QUEUED", 3)
    monkeypatch.setattr(kv_relay, "SYNC_WAIT_S", 0.05)

    async def main():
        client = FakeClient(1)
        relay = KvRelay(client)
        slow, m = relay.subscribe(), Mirror()
        await take(slow, m, 1)
        for h in range(1, 6):
            client.deliver(0, stored([h]))
        with pytest.raises(Unavailable, match="behind"):
            await take(slow, m, 10)
        assert set(m.blocks) == {1, 2, 3}, "what it had before it fell behind"
        assert not relay.streams
        fresh, m2 = relay.subscribe(), Mirror()  # a resubscription resyncs
        await take(fresh, m2, 1)
        assert m2.blocks == {} and client.links[0].q.sent[-1] == KvSubscribe(on=True)
        relay.close()
        with pytest.raises(StopAsyncIteration):
            await fresh.__anext__()

    asyncio.run(main())
