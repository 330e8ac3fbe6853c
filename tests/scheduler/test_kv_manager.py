"""The KV manager's admit / extend / cache / release cycle over the radix cache and the slot
allocator: prefix reuse, chunked prefill, concurrent duplicates, and freed slots coming back in
rising runs (the host tier copies one run of consecutive slots per DMA).
"""

from __future__ import annotations

import pytest

from services.scheduler.kv import KVManager
from services.scheduler.memory import OutOfSlots, SlotAllocator
from services.scheduler.request import Req
from shared.messages.common import SamplingParams


def make_req(rid: str, prompt: list[int], ns: str = "") -> Req:
    return Req(rid=rid, replica=b"t", prompt=list(prompt), params=SamplingParams(max_new_tokens=16), ns=ns)


def prefill(kv: KVManager, r: Req, running: list[Req], chunk: int = 1 << 30) -> None:
    while r.to_compute > 0:
        kv.extend(r, min(chunk, r.to_compute))
        kv.check_integrity(running)
        kv.cache_prefix(r)
        kv.check_integrity(running)


def decode(kv: KVManager, r: Req, running: list[Req], tokens: list[int]) -> None:
    for t in tokens:
        r.output.append(t)
        kv.extend(r, 1)
        assert len(r.slots) == r.seq_len
        kv.check_integrity(running)


@pytest.mark.parametrize("P", [1, 4])
def test_kv_manager_cycle(P: int) -> None:
    kv = KVManager(pool_size=64 * P - 1, max_rows=4, page_size=P)
    pool = kv.pool_size
    system = list(range(1000, 1013))  # 13 tokens: 3 whole pages of 4 + 1
    a = make_req("a", system + [1, 2, 3, 4, 5, 6])
    kv.admit(a)
    running = [a]
    assert a.slots == [] and a.cached_tokens == 0
    kv.check_integrity(running)
    prefill(kv, a, running, chunk=5)  # chunked prefill: insert as it goes
    assert len(a.slots) == len(a.prompt)
    decode(kv, a, running, [7, 8, 9])

    b = make_req("b", system + [50, 51])  # shares the system prompt
    assert kv.peek_prefix(b) == 13 - 13 % P
    kv.admit(b)
    running.append(b)
    assert b.cached_tokens == 13 - 13 % P and b.slots == a.slots[:b.cached_tokens]
    kv.check_integrity(running)
    prefill(kv, b, running)
    decode(kv, b, running, [60, 61])
    if P > 1:  # b's last page is partly filled; its next token continues it
        last = b.slots[-1]
        assert last % P != P - 1
        kv.extend(b, 1)
        b.output.append(62)
        assert b.slots[-1] == last + 1
        kv.check_integrity(running)

    running.remove(a)
    kv.release(a)
    kv.check_integrity(running)
    assert a.row == -1 and a.slots == [] and not a.owned and a.lock_node is None
    running.remove(b)
    kv.release(b)
    kv.check_integrity(running)
    cached = kv.cache.evictable_size
    assert kv.cache.locked_size == 0 and kv.slots.num_free + cached == pool

    c = make_req("c", a.prompt + a.output + [70])  # a's whole sequence was cached on release
    kv.admit(c)
    running.append(c)
    full = len(c.prefix_key()) - len(c.prefix_key()) % P
    assert c.cached_tokens == full
    kv.extend(c, c.to_compute)  # computed, never inserted
    kv.check_integrity(running)
    running.remove(c)
    kv.release(c, keep=False)  # bad KV: nothing new is cached, its own slots are freed
    kv.check_integrity(running)
    assert kv.cache.evictable_size == cached and kv.slots.num_free + cached == pool

    # memory pressure: a long prompt evicts the cache (unlocked) to fit
    d = make_req("d", list(range(5000, 5000 + pool - P)))
    kv.admit(d)
    running.append(d)
    assert d.cached_tokens == 0
    prefill(kv, d, running, chunk=16 * P)
    assert kv.counters.evicted_tokens >= cached - (kv.slots.num_free + kv.cache.evictable_size)
    with pytest.raises(OutOfSlots):
        while True:
            d.output.append(1)
            kv.extend(d, 1)
    d.output.pop()
    kv.check_integrity(running)
    running.remove(d)
    kv.release(d)
    kv.check_integrity(running)
    kv.cache.evict(10**9)
    assert kv.slots.num_free == pool and kv.cache.evictable_size == 0
    assert kv.take_released_rows() == [0, 1, 1, 1] and kv.rows.num_free == 4  # a, b, c, d's rows


@pytest.mark.parametrize("P", [1, 4])
def test_kv_manager_concurrent_duplicates(P: int) -> None:
    """Two requests compute the same prompt at once: the second one's slots are duplicates, which it
    keeps (and frees on release) while the tree holds the first one's."""
    kv = KVManager(pool_size=32 * P - 1, max_rows=4, page_size=P)
    prompt = list(range(300, 311))
    a, b = make_req("a", prompt), make_req("b", prompt)
    kv.admit(a)
    kv.admit(b)
    running = [a, b]
    kv.extend(a, a.to_compute)
    kv.extend(b, b.to_compute)
    kv.check_integrity(running)
    kv.cache_prefix(a)
    kv.cache_prefix(b)  # all cached already: b's pages stay its own
    kv.check_integrity(running)
    aligned = 11 - 11 % P
    assert set(b.slots) <= b.owned and kv.cache.locked_size == aligned
    for r in (a, b):
        running.remove(r)
        kv.release(r)
        kv.check_integrity(running)
    assert kv.slots.num_free + kv.cache.evictable_size == kv.pool_size


@pytest.mark.parametrize("P", [1, 4])
def test_freed_slots_come_back_in_rising_runs(P: int) -> None:
    """What a node frees is handed out again as consecutive rising slots (whatever order it was
    freed in): the host tier moves one run of consecutive slots per DMA, so reversed runs would
    cost one copy per token (W2 with the host tier lost 15 % to that on the H200)."""
    alloc = SlotAllocator(64 * P - 1, P)
    a, b = alloc.alloc(None, 16 * P), alloc.alloc(None, 16 * P)
    alloc.free(a[::-1])
    alloc.free(b)
    again = alloc.alloc(None, 32 * P)
    assert again[: 16 * P] == sorted(b) and again[16 * P:] == sorted(a)
    assert again == sorted(again[: 16 * P]) + sorted(again[16 * P:])
