"""RadixCache: a stateful property test against a brute-force model, LRU order, pages, namespaces
and splits (the KV manager's cycle over it: ``test_kv_manager.py``).

The model of the cache is a dict ``(namespace, tuple(prefix)) -> slots`` holding every cached prefix
of whole pages (so it is prefix-closed); each entry's own page is the last ``page_size`` slots.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from services.scheduler.cache import RadixCache
from services.scheduler.memory import SlotAllocator

ALPHA = st.integers(0, 2)  # tiny alphabet: prefixes collide
NS = st.sampled_from(["", "b"])
MAX_LEN = 40


def path_of(cache: RadixCache, node, ns_hint: str | None = None) -> tuple[str, list[int]]:
    """(namespace, tokens from the root to ``node``); fails if ``node`` is detached. A namespace
    with no entries has no root: its handle (None from peek, a detached root from match) is the
    empty path of ``ns_hint``."""
    if ns_hint is not None and (node is None or (node.parent is None and node not in cache._roots.values())):
        return ns_hint, []
    parts = []
    while node.parent is not None:
        assert node.parent.children.get(cache._edge(node.key, 0)) is node, "node is detached"
        parts.append(node.key)
        node = node.parent
    ns = [n for n, r in cache._roots.items() if r is node]
    assert len(ns) == 1, "node is not under a root"
    return ns[0], [t for k in reversed(parts) for t in k]


def snapshot(cache: RadixCache):
    """Everything observable about the tree (structure, values, locks, clocks, counters)."""
    out = []
    for ns, root in sorted(cache._roots.items()):
        if not root.children:
            continue  # an empty root (``_root`` creates one for any namespace it is asked about)
        stack = [root]
        while stack:
            n = stack.pop()
            out.append((ns, id(n), id(n.parent), tuple(n.key), tuple(n.value), n.lock_ref, n.last_access,
                        tuple(sorted((repr(k), id(c)) for k, c in n.children.items()))))
            stack.extend(n.children.values())
    return (out, cache._clock, cache.evictable_size, cache.locked_size, frozenset(map(id, cache._leaves)))


# ---- stateful test ------------------------------------------------------------------------------
class RadixMachine(RuleBasedStateMachine):
    @initialize(page_size=st.sampled_from([1, 4]), tokens=st.integers(40, 160))
    def setup(self, page_size: int, tokens: int) -> None:
        self.P = P = page_size
        pages = tokens // P
        self.alloc = SlotAllocator((pages + 1) * P - 1, P)
        assert self.alloc.num_pages == pages
        self.freed: list[int] = []  # slots the cache handed back during the current evict

        def free(slots):
            slots = list(slots)
            self.freed.extend(slots)
            self.alloc.free(slots)

        self.cache = RadixCache(free, P)
        self.model: dict[tuple[str, tuple[int, ...]], list[int]] = {}
        self.locks: list[tuple[str, tuple[int, ...], object]] = []  # held: (ns, prefix, node)
        self.keys: list[list[int]] = [[]]

    # ---- model helpers -----------------------------------------------------------------------
    def draw_key(self, data, remember: bool = False) -> list[int]:
        if data.draw(st.integers(0, 3), label="derived"):  # mostly: an earlier key's prefix + a new tail
            base = data.draw(st.sampled_from(self.keys), label="base")
            cut = data.draw(st.integers(0, len(base)), label="cut")
            if data.draw(st.booleans(), label="page cut"):
                cut -= cut % self.P
            key = base[:cut] + data.draw(st.lists(ALPHA, max_size=MAX_LEN - cut), label="tail")
        else:
            key = data.draw(st.lists(ALPHA, max_size=MAX_LEN), label="key")
        if remember and len(self.keys) < 64:
            self.keys.append(key)
        return key

    def model_len(self, ns: str, key) -> int:
        j = 0
        while j + self.P <= len(key) and (ns, tuple(key[:j + self.P])) in self.model:
            j += self.P
        return j

    def model_slots(self, ns: str, key, j: int) -> list[int]:
        return self.model[(ns, tuple(key[:j]))] if j else []

    def locked_prefixes(self) -> set:
        return {(ns, p[:j]) for ns, p, _ in self.locks for j in range(self.P, len(p) + 1, self.P)}

    def do_evict(self, k: int) -> int:
        before = self.cache.evictable_size
        locked = self.locked_prefixes()
        self.freed = []
        got = self.cache.evict(k)
        freed = set(self.freed)
        assert got == len(self.freed) == len(freed), "evict's count differs from the slots it freed"
        assert got <= before
        assert got >= (min(k, before) if k > 0 else 0), f"evict({k}) freed {got} of {before} evictable"
        assert self.cache.evictable_size == before - got
        dropped = {e: s for e, s in self.model.items() if freed.intersection(s)}
        assert not locked & dropped.keys(), "evicted a locked prefix"
        assert freed == {x for s in dropped.values() for x in s[-self.P:]}, "freed slots are not whole entries"
        for e in dropped:
            del self.model[e]
        for ns, p in self.model:
            assert len(p) == self.P or (ns, p[:-self.P]) in self.model, "model lost prefix-closedness"
        return got

    def make_room(self, last, n: int) -> bool:
        need = self.alloc.tokens_needed(last, n)
        if need > self.alloc.num_free:
            self.do_evict(need - self.alloc.num_free)
        return need <= self.alloc.num_free

    def insert(self, ns: str, key: list[int], slots: list[int], owned_from: int) -> None:
        """Insert as kv.py does; the caller owns ``slots[owned_from:]`` and frees what the cache did
        not take."""
        P = self.P
        expect = self.model_len(ns, key)
        end = len(key) - len(key) % P
        assert expect >= owned_from
        res = self.cache.insert(ns, key, slots)
        assert res.cached == expect, f"insert returned {res.cached}, {expect} tokens were cached"
        assert res.stored == end and path_of(self.cache, res.handle) == (ns, key[:res.stored]), \
            "the handle does not cover exactly what is stored"
        base = self.model_slots(ns, key, expect)
        for j in range(expect + P, end + 1, P):
            self.model[(ns, tuple(key[:j]))] = base + slots[expect:j]
        rest = slots[owned_from:expect] + slots[end:]
        if rest:
            self.alloc.free(rest)

    # ---- rules -------------------------------------------------------------------------------
    @rule(data=st.data(), ns=NS)
    def insert_fresh(self, data, ns: str) -> None:
        key = self.draw_key(data, remember=True)
        if self.make_room(None, len(key)):
            self.insert(ns, key, self.alloc.alloc(None, len(key)), 0)

    @rule(data=st.data(), ns=NS)
    def match_extend_insert(self, data, ns: str) -> None:
        """A request: match + lock its cached prefix, allocate the rest after it, insert, unlock."""
        key = self.draw_key(data, remember=True)
        m = self.cache.match(ns, key)
        k = len(m.slots)
        assert m.slots == self.model_slots(ns, key, k) and k == self.model_len(ns, key)
        self.cache.lock(m.handle)
        self.locks.append((ns, tuple(key[:k]), m.handle))
        last = m.slots[-1] if m.slots else None
        if self.make_room(last, len(key) - k):
            new = self.alloc.alloc(last, len(key) - k)
            self.insert(ns, key, m.slots + new, k)
        self.locks.pop()
        self.cache.unlock(m.handle)

    @rule(data=st.data(), ns=NS, lock=st.booleans())
    def match(self, data, ns: str, lock: bool) -> None:
        key = self.draw_key(data)
        j = self.model_len(ns, key)
        m = self.cache.match(ns, key)
        assert len(m.slots) == j and j % self.P == 0, f"matched {len(m.slots)}, model has {j}"
        assert m.slots == self.model_slots(ns, key, j)
        assert path_of(self.cache, m.handle, ns) == (ns, key[:j]), "node does not cover exactly the match"
        if lock:
            self.cache.lock(m.handle)
            self.locks.append((ns, tuple(key[:j]), m.handle))

    @precondition(lambda self: self.locks)
    @rule(data=st.data())
    def unlock(self, data) -> None:
        i = data.draw(st.integers(0, len(self.locks) - 1), label="lock")
        _, _, node = self.locks.pop(i)
        self.cache.unlock(node)

    @rule(k=st.integers(-1, 2 * MAX_LEN))
    def evict(self, k: int) -> None:
        self.do_evict(k)

    @rule(data=st.data(), ns=NS)
    def peek(self, data, ns: str) -> None:
        key = self.draw_key(data)
        before = snapshot(self.cache)
        n, node = self.cache.peek(ns, key)
        assert snapshot(self.cache) == before, "peek changed the tree"
        assert n == self.model_len(ns, key)
        pns, path = path_of(self.cache, node, ns)  # the deepest node reached, possibly partly matched
        edge = len(node.key) if node is not None else 0
        assert pns == ns and path[:n] == key[:n] and len(path) - edge <= n <= len(path)

    # ---- invariants --------------------------------------------------------------------------
    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "cache"):
            return
        P, cache, alloc = self.P, self.cache, self.alloc
        cache.check_integrity()
        cached = len(self.model) * P
        assert cache.evictable_size + cache.locked_size == cached
        assert cache.locked_size == len(self.locked_prefixes()) * P
        assert alloc.num_free + cached == alloc.pool_size, "a KV slot leaked"
        alloc.check_integrity(cached // P)
        tree = sorted(cache.all_slots())
        assert tree == sorted(x for s in self.model.values() for x in s[-P:])
        assert not {x // P for x in tree} & set(alloc._free), "a cached page is also free"
        for ns, p, node in self.locks:
            assert path_of(cache, node, ns) == (ns, list(p)), "a held node moved"

    def teardown(self) -> None:
        if not hasattr(self, "cache"):
            return
        while self.locks:
            self.cache.unlock(self.locks.pop()[2])
        self.do_evict(10**9)
        assert not self.model and self.cache.evictable_size == self.cache.locked_size == 0
        assert self.alloc.num_free == self.alloc.pool_size



TestRadixMachine = RadixMachine.TestCase
TestRadixMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# ---- unit tests -----------------------------------------------------------------------------------
class Freed(list):
    """A free-slots callback recording what the cache hands back, one list per call."""

    def __call__(self, slots) -> None:
        self.append(list(slots))


def test_page_size_4() -> None:
    P = 4
    alloc = SlotAllocator(20 * P - 1, P)
    c = RadixCache(alloc.free, P)
    key = list(range(100, 110))  # 10 tokens: 2 whole pages + 2
    slots = alloc.alloc(None, 10)
    assert [s // P for s in slots] == [1] * 4 + [2] * 4 + [3] * 2 and slots[0] == 4
    assert c.insert("", key, slots).cached == 0
    alloc.free(slots[8:])  # the partial page is never cached: the caller keeps and frees it
    assert (c.evictable_size, c.locked_size) == (8, 0)
    assert alloc.num_free + 8 == alloc.pool_size
    assert c.match("", key).slots == slots[:8]
    for n, want in [(11, 8), (9, 8), (8, 8), (7, 4), (5, 4), (4, 4), (3, 0), (0, 0)]:
        assert len(c.match("", key[:n]).slots) == want and c.peek("", key[:n]).length == want
    assert c.match("", key[:6] + [0, 0, 0, 0]).slots == slots[:4]  # diverges inside page 2
    assert c.peek("", [100, 101, 102, 0]).length == 0  # diverges inside page 1
    assert c.insert("", key + [1, 2, 3], alloc.alloc(None, 13)[:13]).cached == 8
    c.check_integrity()
    # a request fills the tail of its partly filled last page before taking a new one
    mine = alloc.alloc(None, 6)
    more = alloc.alloc(mine[-1], 3)
    assert more[:2] == [mine[-1] + 1, mine[-1] + 2] and more[2] % P == 0 and more[2] // P not in {s // P for s in mine}
    assert alloc.tokens_needed(mine[-1], 2) == 0 and alloc.tokens_needed(mine[-1], 3) == P
    assert alloc.tokens_needed(more[-1], P - 1) == 0 and alloc.tokens_needed(None, 1) == P


def test_page_size_4_insert_truncates_to_pages() -> None:
    c = RadixCache(lambda s: None, 4)
    assert c.insert("", [1, 2, 3], [5, 6, 7]).cached == 0  # shorter than a page: nothing stored
    assert (c.evictable_size, c.match("", [1, 2, 3]).slots) == (0, [])
    assert c.insert("", [1, 2, 3, 4, 5, 6, 7, 8], [4, 5, 6, 7]).cached == 0  # truncated to min(key, slots)
    assert c.evictable_size == 4 and c.match("", [1, 2, 3, 4, 5, 6, 7, 8]).slots == [4, 5, 6, 7]
    c.check_integrity()


def test_namespaces_never_share() -> None:
    for P in (1, 4):
        freed = Freed()
        c = RadixCache(freed, P)
        key = [1, 2, 3, 4, 5, 6, 7, 8]
        assert c.insert("a", key, list(range(8, 16))).cached == 0
        assert c.peek("b", key).length == 0
        m = c.match("b", key)
        assert m.slots == [] and m.handle.parent is None and m.handle is not c.match("a", []).handle
        assert c.insert("b", key, list(range(16, 24))).cached == 0  # not cached in "b" yet
        assert c.match("a", key).slots == list(range(8, 16))
        assert c.match("b", key).slots == list(range(16, 24))
        assert c.insert("", key, list(range(24, 32))).cached == 0  # the default namespace is a third one
        m = c.match("a", key)
        c.lock(m.handle)
        assert c.evict(100) == 16 and sorted(x for f in freed for x in f) == list(range(16, 32))
        assert c.match("a", key).slots == list(range(8, 16)) and c.peek("b", key).length == 0
        c.unlock(m.handle)
        c.check_integrity()


def test_split_on_match() -> None:
    freed = Freed()
    c = RadixCache(freed)
    c.insert("", list(range(1, 9)), list(range(11, 19)))
    assert len(c._roots[""].children) == 1
    m = c.match("", [1, 2, 3, 4, 99])
    assert m.slots == [11, 12, 13, 14]
    assert path_of(c, m.handle) == ("", [1, 2, 3, 4]) and m.handle.key == [1, 2, 3, 4]
    assert [ch.key for ch in m.handle.children.values()] == [[5, 6, 7, 8]]
    c.check_integrity()
    c.lock(m.handle)  # locking the upper half leaves the lower half evictable
    assert (c.locked_size, c.evictable_size) == (4, 4)
    c.check_integrity()
    assert c.evict(100) == 4 and freed == [[15, 16, 17, 18]]
    assert c.match("", list(range(1, 9))).slots == [11, 12, 13, 14]
    c.unlock(m.handle)
    assert (c.locked_size, c.evictable_size) == (0, 4)
    c.check_integrity()
    # a lock taken before a split stays on the lower node and its new parent, not on siblings
    c.insert("", [1, 2, 3, 4, 5, 6], [11, 12, 13, 14, 15, 16])
    deep = c.match("", [1, 2, 3, 4, 5, 6]).handle
    c.lock(deep)
    c.match("", [1, 2, 7])  # splits 1-2-3-4 after 1-2
    c.insert("", [1, 2, 7, 8], [11, 12, 27, 28])
    c.check_integrity()
    assert c.locked_size == 6 and c.evictable_size == 2
    assert c.evict(100) == 2 and freed[-1] == [27, 28]
    c.unlock(deep)
    assert c.evict(100) == 6
    c.check_integrity()


def test_split_on_match_page_size_4() -> None:
    c = RadixCache(lambda s: None, 4)
    c.insert("", list(range(12)), list(range(4, 16)))
    m = c.match("", list(range(6)))
    assert m.slots == [4, 5, 6, 7] and m.handle.key == [0, 1, 2, 3]
    c.lock(m.handle)
    assert (c.locked_size, c.evictable_size) == (4, 8)
    c.check_integrity()


def test_insert_existing_key_returns_its_length() -> None:
    for P in (1, 4):
        c = RadixCache(lambda s: None, P)
        key = list(range(10))
        assert c.insert("", key, list(range(10, 20))).cached == 0
        aligned = 10 - 10 % P
        assert c.insert("", key, list(range(30, 40))).cached == aligned
        assert c.insert("", key[:8], list(range(30, 38))).cached == 8  # a prefix (may split)
        assert c.insert("", key + [7] * 6, list(range(40, 56))).cached == aligned
        assert c.match("", key).slots == list(range(10, 10 + aligned))  # the first insert's slots stay
        assert c.evictable_size == 16 - 16 % P
        c.check_integrity()
