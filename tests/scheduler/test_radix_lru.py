"""RadixCache's LRU: eviction order, peeks that do not refresh, parents becoming leaves, locked
leaves skipped, and (property) the order always that of last access."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from services.scheduler.cache import RadixCache
from tests.scheduler.test_radix_cache import Freed


def test_lru_evicts_least_recently_used_leaf() -> None:
    freed = Freed()
    c = RadixCache(freed)
    c.insert("", [1, 2, 3], [11, 12, 13])
    c.insert("", [4, 5, 6], [14, 15, 16])
    c.insert("", [7, 8, 9], [17, 18, 19])
    c.match("", [1, 2, 3])  # refresh 1-2-3: 4-5-6 is now the oldest
    assert c.evict(1) == 3 and freed[-1] == [14, 15, 16]
    c.insert("", [7, 8, 9], [27, 28, 29])  # re-inserting an existing key refreshes it
    assert c.evict(1) == 3 and freed[-1] == [11, 12, 13]
    assert c.evict(1) == 3 and freed[-1] == [17, 18, 19]
    assert c.evict(1) == 0 and len(freed) == 3
    c.check_integrity()


def test_lru_peek_does_not_refresh() -> None:
    freed = Freed()
    c = RadixCache(freed)
    c.insert("", [1, 2], [11, 12])
    c.insert("", [3, 4], [13, 14])
    assert c.peek("", [1, 2, 9]).length == 2
    assert c.evict(1) == 2 and freed == [[11, 12]]


def test_lru_parent_becomes_leaf_in_order() -> None:
    freed = Freed()
    c = RadixCache(freed)
    c.insert("", [1, 2, 3], [11, 12, 13])  # t1
    c.insert("", [1, 2, 3, 4, 5], [11, 12, 13, 14, 15])  # t2: 1-2-3 gets a child 4-5
    c.insert("", [7], [17])  # t3
    assert (c.evict(1), freed[-1]) == (2, [14, 15])
    assert (c.evict(1), freed[-1]) == (3, [11, 12, 13])  # the parent (t2) is now the oldest leaf
    assert (c.evict(1), freed[-1]) == (1, [17])
    c.check_integrity()


def test_lru_skips_locked_leaves() -> None:
    freed = Freed()
    c = RadixCache(freed)
    c.insert("", [1, 2], [11, 12])
    c.insert("", [3, 4], [13, 14])
    m = c.match("", [1, 2])
    c.lock(m.handle)
    c.match("", [3, 4])  # 3-4 is the most recent, but 1-2 is locked
    assert c.evict(1) == 2 and freed == [[13, 14]]
    assert c.evict(100) == 0
    assert (c.evictable_size, c.locked_size) == (0, 2)
    c.unlock(m.handle)
    assert c.evict(1) == 2 and freed[-1] == [11, 12]
    c.check_integrity()


@given(st.lists(st.tuples(st.sampled_from(["match", "long", "insert", "peek"]), st.integers(0, 7)), max_size=40),
       st.integers(1, 8))
@settings(max_examples=100, deadline=None)
def test_lru_order_matches_last_access(ops, n) -> None:
    """Disjoint keys (no shared edges): evicting one leaf at a time frees them in the order of their
    last match/insert (peeks do not count)."""
    freed = Freed()
    c = RadixCache(freed)
    keys = [[k, 100 + k, 200 + k] for k in range(8)]
    last: dict[int, int] = {}
    clock = itertools.count()
    for k in range(n):
        c.insert("", keys[k], [3 * k + 1, 3 * k + 2, 3 * k + 3])
        last[k] = next(clock)
    for op, k in ops:
        k %= n
        if op == "match":
            assert len(c.match("", keys[k]).slots) == 3
        elif op == "long":
            assert len(c.match("", keys[k] + [5, 6]).slots) == 3
        elif op == "insert":
            assert c.insert("", keys[k], [0, 0, 0]).cached == 3
        else:
            assert c.peek("", keys[k]).length == 3
            continue
        last[k] = next(clock)
    for k in sorted(last, key=last.get):
        assert c.evict(1) == 3 and freed[-1] == [3 * k + 1, 3 * k + 2, 3 * k + 3]
    assert c.evict(1) == 0
