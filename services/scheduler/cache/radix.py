"""Radix-tree prefix cache (RadixAttention): token-id edges, KV-slot values, LRU eviction.

Every edge holds a whole number of pages. A node's children are keyed by the first page of their
edge (the first token id when the page size is 1). One root per namespace; roots are never
evicted. Timestamps are a logical clock (one tick per match/insert), so LRU order is exact.

The device sizes count ``len(node.value)``: here every node's KV is in the pool, so that is its
edge length; ``TieredRadixCache`` (tiers.py) keeps nodes whose KV left the pool (``value`` empty),
which match never walks into, and overrides what differs (``node_type``, ``_split``,
``_device_leaf``, ``insert``, ``_evict_leaf``, ``check_integrity``).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence

from services.scheduler.cache.base import InsertResult, MatchResult, PeekResult, PrefixCache


_NODE_SEQ = itertools.count()


class Node:
    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access", "depth", "seq")

    def __init__(self, key: list[int], value: list[int], parent: Node | None, tick: int = 0) -> None:
        self.children: dict = {}
        self.parent = parent
        self.key = key  # token ids of the edge into this node
        self.value = value  # KV slot per token of the edge
        self.lock_ref = 0
        self.last_access = tick
        # tokens from the root to the end of this edge: fixed for the node's life (a split puts a
        # new node above it, ending where its edge now starts)
        self.depth = (parent.depth if parent is not None else 0) + len(key)
        self.seq = next(_NODE_SEQ)  # (creation order: the heaps' tie-break, the same on every run)

    @property
    def last_slot(self) -> int:
        return self.value[-1] if self.value else -1

    def __lt__(self, other: Node) -> bool:  # heap tie-break
        return self.seq < other.seq


def _as_list(key: Sequence[int]) -> list[int]:
    return key if isinstance(key, list) else list(key)


def common_len(edge: list[int], key: Sequence[int], start: int) -> int:
    """Length of the common prefix of ``edge`` and ``key[start:]``, by slice compares (C speed)."""
    n = min(len(edge), len(key) - start)
    if edge[:n] == key[start:start + n]:
        return n
    lo, hi = 0, n  # edge[:lo] matches, edge[:hi] does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if edge[lo:mid] == key[start + lo:start + mid]:
            lo = mid
        else:
            hi = mid
    return lo


class RadixCache(PrefixCache):
    node_type: type[Node] = Node

    def __init__(self, free_slots: Callable[[list[int]], None], page_size: int = 1) -> None:
        assert page_size >= 1
        self.page_size = page_size
        self._free_slots = free_slots
        self._roots: dict[str, Node] = {}
        self._root_ns: dict[int, str] = {}  # id(root) → namespace
        self._nowhere = self.node_type([], [], None)  # match handle in a namespace with no entries (lock: no-op)
        self._leaves: set[Node] = set()  # evictable leaves: no children, unlocked, not a root
        self._evictable = 0
        self._locked = 0
        self._clock = 0

    # ---- helpers ---------------------------------------------------------------------------
    def _root(self, ns: str) -> Node:
        root = self._roots.get(ns)
        if root is None:
            root = self._roots[ns] = self.node_type([], [], None)
            root.lock_ref = 1  # roots are pinned
            self._root_ns[id(root)] = ns
        return root

    def _edge(self, key: Sequence[int], pos: int):
        return key[pos] if self.page_size == 1 else tuple(key[pos:pos + self.page_size])

    def _aligned(self, n: int) -> int:
        return n - n % self.page_size

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _split(self, child: Node, n: int) -> Node:
        """Cut ``child``'s edge after ``n`` tokens; returns the new upper node."""
        parent = child.parent
        assert parent is not None
        upper = self.node_type(child.key[:n], child.value[:n], parent, child.last_access)
        upper.lock_ref = child.lock_ref
        parent.children[self._edge(upper.key, 0)] = upper
        child.key, child.value, child.parent = child.key[n:], child.value[n:], upper
        upper.children[self._edge(child.key, 0)] = child
        return upper

    def _descend(self, ns: str, key: list[int], split: bool, tick: int) -> tuple[Node | None, int, list[list[int]]]:
        """Walk down along ``key``; returns the deepest node (None: the namespace has no root
        yet), matched length and the edge values. ``tick`` > 0 refreshes the nodes it uses."""
        node = self._roots.get(ns)
        pos, values = 0, []
        end = self._aligned(len(key)) if node is not None else 0
        while pos < end:
            child = node.children.get(self._edge(key, pos))
            if child is None or not child.value:  # (not in the device pool: see tiers.py)
                break
            n = self._aligned(common_len(child.key, key, pos))
            if n < len(child.key):
                if split:  # only the used upper part is refreshed; the rest keeps its LRU age
                    child = self._split(child, n)
                    if tick:
                        child.last_access = tick
                    values.append(child.value)
                    node, pos = child, pos + n
                else:  # no split: report the partly matched child (its subtree holds the prefix)
                    node, pos = child, pos + n
                break
            if tick:
                child.last_access = tick
            values.append(child.value)
            node, pos = child, pos + n
        return node, pos, values

    # ---- PrefixCache -----------------------------------------------------------------------
    def match(self, ns: str, key: Sequence[int]) -> MatchResult:
        node, _, values = self._descend(ns, _as_list(key), split=True, tick=self._tick())
        slots: list[int] = []
        for v in values:
            slots += v
        return MatchResult(slots, node if node is not None else self._nowhere)

    def peek(self, ns: str, key: Sequence[int]) -> PeekResult:
        node, pos, _ = self._descend(ns, _as_list(key), split=False, tick=0)
        return PeekResult(pos, node)

    def insert(self, ns: str, key: Sequence[int], slots: Sequence[int]) -> InsertResult:
        end = self._aligned(min(len(key), len(slots)))
        self._root(ns)
        node, pos, _ = self._descend(ns, _as_list(key[:end]), split=True, tick=self._tick())
        if pos < end:
            leaf = self.node_type(list(key[pos:end]), list(slots[pos:end]), node, self._clock)
            node.children[self._edge(leaf.key, 0)] = leaf
            self._leaves.discard(node)
            self._leaves.add(leaf)
            self._evictable += end - pos
            node = leaf
            if self.listener is not None:
                self.listener.stored(ns, key, pos, end)
        return InsertResult(pos, end, node)

    def lock(self, node: Node) -> None:
        while node.parent is not None:
            if node.lock_ref == 0:
                self._evictable -= len(node.value)
                self._locked += len(node.value)
                self._leaves.discard(node)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: Node) -> None:
        while node.parent is not None:
            assert node.lock_ref > 0, "unlock without lock"
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._evictable += len(node.value)
                self._locked -= len(node.value)
                if node.value and self._device_leaf(node):
                    self._leaves.add(node)
            node = node.parent

    def path(self, handle: Node) -> list[Node]:
        out = []
        while handle.parent is not None:  # (the root holds no tokens)
            out.append(handle)
            handle = handle.parent
        out.reverse()
        return out

    def subtree_order(self, handles: Sequence[Node | None]) -> list[int]:
        at: dict[int, list[int]] = {}  # node → indices of the handles there
        weight: dict[int, int] = {}  # node → handles in its subtree
        tops: dict[int, Node | None] = {}  # roots reached (None: the handles of empty namespaces)
        for i, h in enumerate(handles):
            at.setdefault(id(h), []).append(i)
            if h is None:
                weight[id(None)] = weight.get(id(None), 0) + 1
                tops[id(None)] = None
            n = h
            while n is not None:
                weight[id(n)] = weight.get(id(n), 0) + 1
                if n.parent is None:
                    tops[id(n)] = n
                n = n.parent
        out: list[int] = []
        stack = sorted(tops.values(), key=lambda n: weight[id(n)])
        while stack:
            n = stack.pop()  # the heaviest of its siblings first
            out.extend(at.get(id(n), ()))
            if n is not None:
                stack.extend(sorted((c for c in n.children.values() if id(c) in weight), key=lambda c: weight[id(c)]))
        return out

    def _device_leaf(self, node: Node) -> bool:
        """No child of ``node`` holds KV in the pool (eviction takes such nodes, deepest first)."""
        return not node.children

    def evict(self, num_tokens: int) -> int:
        """Evict least recently used device leaves (``_evict_leaf``) until ``num_tokens`` are freed; a
        parent that becomes a device leaf on the way is a candidate too. → tokens freed."""
        if num_tokens <= 0 or not self._leaves:
            return 0
        heap = [(leaf.last_access, leaf) for leaf in self._leaves]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, leaf = heapq.heappop(heap)
            if leaf not in self._leaves:
                continue
            parent = leaf.parent
            freed += self._evict_leaf(leaf)
            if parent in self._leaves:
                heapq.heappush(heap, (parent.last_access, parent))
        return freed

    def _evict_leaf(self, leaf: Node) -> int:
        """Take an unlocked device leaf out of the tree, its slots freed (its parent may become a
        leaf; an emptied namespace goes). → tokens freed."""
        parent = leaf.parent
        assert parent is not None
        if self.listener is not None:
            self.listener.removed(*self._path_key(leaf), leaf.depth - len(leaf.key), leaf.depth)
        self._leaves.discard(leaf)
        del parent.children[self._edge(leaf.key, 0)]
        self._free_slots(leaf.value)
        self._evictable -= len(leaf.key)
        if parent.parent is not None and not parent.children and parent.lock_ref == 0:
            self._leaves.add(parent)
        elif parent.parent is None and not parent.children:
            self._drop_empty_root(parent)
        return len(leaf.key)

    def _path_key(self, node: Node) -> tuple[str, list[int]]:
        """(namespace, tokens from the root to the end of ``node``)."""
        edges = []
        while node.parent is not None:
            edges.append(node.key)
            node = node.parent
        return self._root_ns[id(node)], [t for e in reversed(edges) for t in e]

    def walk(self):
        for ns, root in list(self._roots.items()):
            stack = list(root.children.values())
            while stack:
                n = stack.pop()
                yield ns, n.depth - len(n.key), n.key
                stack.extend(n.children.values())

    def _drop_empty_root(self, root: Node) -> None:
        """Namespaces come and go (one per cache_salt): an empty one leaves nothing behind."""
        ns = self._root_ns.pop(id(root))
        del self._roots[ns]

    @property
    def evictable_size(self) -> int:
        return self._evictable

    @property
    def locked_size(self) -> int:
        return self._locked

    def all_slots(self) -> list[int]:
        out: list[int] = []
        for root in self._roots.values():
            stack = list(root.children.values())
            while stack:
                n = stack.pop()
                out.extend(n.value)
                stack.extend(n.children.values())
        return out

    def check_integrity(self) -> None:
        evictable = locked = 0
        seen: set[int] = set()
        leaves: set[Node] = set()
        for root in self._roots.values():
            assert root.lock_ref >= 1 and not root.key
            stack = [root]
            while stack:
                node = stack.pop()
                if node.parent is not None:  # locks stop below the (pinned) root
                    assert node.lock_ref >= sum(c.lock_ref for c in node.children.values()), "lock refs"
                for edge, c in node.children.items():
                    assert c.parent is node and edge == self._edge(c.key, 0), "bad edge"
                    assert c.key and len(c.value) in (0, len(c.key)) and len(c.key) % self.page_size == 0
                    assert c.depth == node.depth + len(c.key), "depth"
                    assert not c.value or node.value or node.parent is None, "in the pool below a node that is not"
                    assert seen.isdisjoint(c.value), "a KV slot is cached twice"
                    seen.update(c.value)
                    if c.lock_ref:
                        locked += len(c.value)
                    else:
                        evictable += len(c.value)
                        if c.value and self._device_leaf(c):
                            leaves.add(c)
                    stack.append(c)
        assert (evictable, locked) == (self._evictable, self._locked), "size counters drifted"
        assert leaves == self._leaves, "evictable-leaf set drifted"
