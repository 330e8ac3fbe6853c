"""The tiered radix tree of the hierarchical cache: a node's KV may be in the device pool, in host
memory, on disk — or in several. Metadata only: slot ids and file ids; the worker holds the bytes
and runs the copies this tree asks for (``CacheOp``, acknowledged by op id; ``tier_ops.py``).

Where a node's KV is (each field independent):
- device: ``value`` (pool slots) non-empty. Closed upwards: a node in the pool has its parent in
  it, so ``match``/``peek`` (the ``PrefixCache`` view, unchanged) return a device prefix and never
  walk into a node that is not. ``incoming``: pool slots a load is filling (``value`` once done).
- host: ``host`` (host slots); ``host_ready`` false while a copy into them is in flight.
- disk: ``disk`` = (file id, its offset in the file); ``disk_ready`` false while being written.
A node with no copy is a *hole* (a failed copy, or a pool eviction that had nowhere to put a node
with descendants): fetches stop there, an insert refills it, eviction removes it once a leaf.

What protects what: ``lock_ref`` (requests, fetches, and backups / loads in flight: they lock their
node) keeps the device copy; ``host_busy`` / ``disk_busy`` (ops in flight that read or write that
copy) keep the host / disk copy; a locked node keeps its host copy while it is not in the pool
(a fetch is about to load it); only an idle, unlocked leaf is ever removed.

Eviction, least recently used first in every tier:
- pool (``evict``, when the allocator runs short): a node already on the host or disk drops its
  pool slots; otherwise it is demoted (write-back, or a write-through backup that did not happen or
  that the host has dropped since: a host copy is made, its pool slots are free at once — the worker
  orders the copy before the next forward) if the host has room or holds less recently used copies
  to make room with, else removed (a leaf) or left a hole.
- host (``evict_host``, to make room): drop the host copy of a node in the pool or on disk, remove a
  host-only leaf.
- disk (``evict_disk``): drop a disk reference (a file goes when no node refers to it), remove a
  disk-only leaf.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Iterator, Sequence

from shared.messages.to_worker import CacheOp
from services.scheduler.cache.base import InsertResult
from services.scheduler.cache.radix import Node, RadixCache, common_len
from services.scheduler.cache.tier_disk import DiskTier
from services.scheduler.cache.tier_node import FileRec, Op, TierNode
from services.scheduler.cache.tier_ops import TierOps
from services.scheduler.counters import Counters
from services.scheduler.memory import SlotAllocator


class TieredRadixCache(TierOps, DiskTier, RadixCache):
    node_type = TierNode

    def __init__(self, free_slots: Callable[[list[int]], None], page_size: int, host: SlotAllocator,
                 write_back: bool = False, disk_capacity: int = 0, bytes_per_token: int = 0,
                 next_file: int = 0, counters: Counters | None = None) -> None:
        super().__init__(free_slots, page_size)
        self.host = host
        self.write_back = write_back
        self.counters = counters if counters is not None else Counters()
        self.bytes_per_token = bytes_per_token
        self.inflight: dict[int, Op] = {}  # copies sent, not acknowledged (tier_ops.py)
        self.outbox: list[CacheOp] = []  # copies to send
        self.to_disk: deque[TierNode] = deque()  # host copies waiting for a disk write
        self.disk_writes = 0  # in flight
        self.disk_capacity = disk_capacity  # bytes (0: no disk tier)
        self.files: dict[int, FileRec] = {}
        self.disk_used = 0  # bytes of the files in ``files``
        self.next_file = next_file
        self._incoming = 0  # pool slots of loads in flight (locked: counted in ``locked_size``)
        self._on_host: set[TierNode] = set()
        self._on_disk: set[TierNode] = set()
        self.fresh: list[TierNode] = []  # pool nodes an insert entered or went through with no copy elsewhere
        # (write-through backs them up: a long-running request's prefix whose host copy a small host dropped
        # is copied again when the request's KV goes back into the tree, so evicting it later needs no demote)

    # ---- sizes -----------------------------------------------------------------------------
    @property
    def locked_size(self) -> int:
        return self._locked + self._incoming

    @property
    def host_used(self) -> int:
        return self.host.pool_size - self.host.num_free

    # ---- structure -------------------------------------------------------------------------
    def _device_leaf(self, node: TierNode) -> bool:
        return node.pool_children == 0

    def _split(self, child: TierNode, n: int) -> TierNode:
        upper: TierNode = super()._split(child, n)  # (lock_ref and LRU age copied)
        upper.pool_children = 1 if child.value else 0
        if child.host is not None:
            upper.host, child.host = child.host[:n], child.host[n:]
            self._on_host.add(upper)
        if child.incoming is not None:
            upper.incoming, child.incoming = child.incoming[:n], child.incoming[n:]
        if child.disk is not None:
            f, off = child.disk
            upper.disk, child.disk = (f, off), (f, off + n)
            self.files[f].nodes.add(upper)
            self._on_disk.add(upper)
        upper.host_ready, upper.disk_ready, upper.fill_op = child.host_ready, child.disk_ready, child.fill_op
        upper.host_busy, upper.disk_busy = child.host_busy, child.disk_busy  # (ops cover segments: both halves)
        if child in self.fresh:
            self.fresh.append(upper)
        return upper

    def alive(self, node: TierNode) -> bool:
        p = node.parent
        return p is not None and p.children.get(self._edge(node.key, 0)) is node

    def path_nodes(self, ns: str, key: Sequence[int]) -> list[TierNode]:
        """The nodes ``key`` enters (by at least a page), whatever tier holds them, down to the first
        hole; refreshes their LRU age. Never splits."""
        key = key if isinstance(key, list) else list(key)
        node, pos, out = self._roots.get(ns), 0, []
        end = self._aligned(len(key))
        tick = self._tick()
        while node is not None and pos < end:
            child = node.children.get(self._edge(key, pos))
            if child is None or child.hole:
                break
            n = self._aligned(common_len(child.key, key, pos))
            child.last_access = tick
            out.append(child)
            if n < len(child.key):
                break
            node, pos = child, pos + n
        return out

    # ---- insert: nodes out of the pool take the caller's slots -------------------------------
    def insert(self, ns: str, key: Sequence[int], slots: Sequence[int]) -> InsertResult:
        """As ``RadixCache.insert``; a node out of the pool (on the host, disk, or a hole) on the way
        takes the caller's slots for its tokens (they hold the same KV) and is back in the pool.
        A node being loaded ends the insert there (``stored`` is then shorter than the key)."""
        end = self._aligned(min(len(key), len(slots)))
        node: TierNode = self._root(ns)
        tick = self._tick()
        pos, cached = 0, -1
        while pos < end:
            child = node.children.get(self._edge(key, pos))
            if child is None:
                break
            n = self._aligned(common_len(child.key, key, pos))
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = tick
            if not child.value:
                if child.incoming is not None:
                    return InsertResult(pos if cached < 0 else cached, pos, node)
                if cached < 0:
                    cached = pos
                self.enter_pool(child, list(slots[pos:pos + n]))
                if child.host is None:
                    self.fresh.append(child)
            elif child.host is None and child.disk is None:  # (in use again, its host copy dropped meanwhile:
                self.fresh.append(child)  # write-through copies it again, so its eviction needs no demote)
            node, pos = child, pos + n
        if cached < 0:
            cached = pos
        if pos < end:
            leaf = TierNode(list(key[pos:end]), list(slots[pos:end]), node, tick)
            node.children[self._edge(leaf.key, 0)] = leaf
            node.pool_children += 1
            self._leaves.discard(node)
            self._leaves.add(leaf)
            self._evictable += end - pos
            self.fresh.append(leaf)
            node = leaf
            if self.listener is not None:  # (KV events: a prefix enters the cache once, whatever tier it moves to)
                self.listener.stored(ns, key, pos, end)
        return InsertResult(cached, end, node)

    def enter_pool(self, node: TierNode, slots: list[int]) -> None:
        """``node`` (out of the pool; its parent in it) gets pool ``slots``."""
        node.value = slots
        node.parent.pool_children += 1
        if node.lock_ref:
            self._locked += len(slots)
        else:
            self._evictable += len(slots)
            if self._device_leaf(node):
                self._leaves.add(node)
        self._leaves.discard(node.parent)

    # ---- pool eviction ---------------------------------------------------------------------
    def _evict_leaf(self, node: TierNode) -> int:
        """(``RadixCache.evict``'s step) ``node`` leaves the pool, its KV kept in another tier if it can."""
        parent = node.parent
        freed = self._leave_pool(node)
        if parent.parent is not None and parent.value and not parent.lock_ref and self._device_leaf(parent):
            self._leaves.add(parent)
        return freed

    def _leave_pool(self, node: TierNode) -> int:
        """Free ``node``'s pool slots (an unlocked device leaf), keeping its KV elsewhere if it can."""
        slots, n = node.value, len(node.value)
        self._leaves.discard(node)
        self._evictable -= n
        kept = node.host is not None or node.disk is not None
        # demote — a copy the next forward waits for — only into room that holds less recent KV (LRU over
        # both tiers: with write-through and a host tier smaller than the pool, a victim whose host copy
        # the host has already dropped is older than all it holds, and goes)
        host = None if kept else self.alloc_host(n, older_than=node.last_access)
        node.value = []
        node.parent.pool_children -= 1
        self._leaves.discard(node)  # (again: making room on the host may have removed its last child)
        self._free_slots(slots)
        if host is not None:
            self.set_host(node, host)
            self.demote(node, slots, host)
        elif not kept and not node.children:
            self._remove(node)
        return n

    # ---- host tier -------------------------------------------------------------------------
    def alloc_host(self, n: int, older_than: int | None = None) -> list[int] | None:
        """``n`` host slots (whole pages), evicting host copies if needed (only those used before
        ``older_than``, when given); None if they cannot be had."""
        need = self.host.tokens_needed(None, n)
        if need > self.host.num_free:  # (a 64th of the tier at least: one LRU pass serves many allocations)
            self.evict_host(max(need - self.host.num_free, self.host.pool_size // 64), older_than)
        return self.host.alloc(None, n) if need <= self.host.num_free else None

    def set_host(self, node: TierNode, host: list[int]) -> None:
        node.host, node.host_ready = host, False
        self._on_host.add(node)

    def drop_host(self, node: TierNode) -> None:
        self.host.free(node.host)
        node.host, node.host_ready, node.fill_op = None, False, 0
        self._on_host.discard(node)

    @staticmethod
    def _host_droppable(n: TierNode) -> bool:
        """Idle, and not needed by a fetch (locked out of the pool). A node with descendants left
        with no copy becomes a hole (they come back into reach if an insert refills it)."""
        return n.host_ready and not n.host_busy and n.incoming is None and not (n.lock_ref and not n.value)

    def evict_host(self, num_tokens: int, older_than: int | None = None) -> int:
        """Drop up to ``num_tokens`` of host copies, least recently used first (only those used before
        ``older_than``, when given)."""
        heap = [(n.last_access, -n.depth, n) for n in self._on_host
                if self._host_droppable(n) and (older_than is None or n.last_access < older_than)]
        heapq.heapify(heap)  # (least recently used first; deeper first among equals)
        freed = 0
        while freed < num_tokens and heap:
            node = heapq.heappop(heap)[2]
            if node.host is None or not self._host_droppable(node):
                continue
            freed += len(node.host)
            self.drop_host(node)
            self.prune(node)
        return freed

    # ---- removal ---------------------------------------------------------------------------
    def unlock(self, node: Node) -> None:
        super().unlock(node)
        self.prune(node)

    def prune(self, node: TierNode) -> None:
        """Remove ``node`` if it is a hole nothing needs (an idle, unlocked leaf with no copy)."""
        if (node.parent is not None and not node.children and not node.lock_ref and not node.host_busy
                and not node.disk_busy and node.hole and self.alive(node)):
            self._remove(node)

    def _remove(self, node: TierNode) -> None:
        """Take an unlocked, idle leaf out of the tree, with whatever copies it still has."""
        assert not node.children and not node.lock_ref and not node.host_busy and not node.disk_busy
        if self.listener is not None:  # (it leaves the cache: no tier holds it any more)
            self.listener.removed(*self._path_key(node), node.depth - len(node.key), node.depth)
        if node.value:
            self._leaves.discard(node)
            self._evictable -= len(node.value)
            self._free_slots(node.value)
            node.value = []
            node.parent.pool_children -= 1
        if node.host is not None:
            self.drop_host(node)
        if node.disk is not None:
            self.drop_disk(node)
        parent = node.parent
        del parent.children[self._edge(node.key, 0)]
        if parent.parent is None:
            if not parent.children:
                self._drop_empty_root(parent)
        elif parent.value and not parent.lock_ref and self._device_leaf(parent):
            self._leaves.add(parent)
        elif parent.hole and not parent.children and not parent.lock_ref:
            self._remove(parent)

    def flush(self) -> int:
        """Every idle, unlocked prefix out of every tier (pool, then host, then disk)."""
        freed = self.evict(self._evictable)
        self.evict_host(self.host_used)
        self.evict_disk(self.disk_used)
        return freed

    # ---- checks ----------------------------------------------------------------------------
    def nodes(self) -> Iterator[TierNode]:
        for root in self._roots.values():
            stack = list(root.children.values())
            while stack:
                n = stack.pop()
                yield n
                stack.extend(n.children.values())

    def check_integrity(self) -> None:
        super().check_integrity()  # structure, pool slots and their counters, locks
        host_seen: set[int] = set()
        incoming: set[int] = set()
        on_host, on_disk, busy = set(), set(), self.expected_busy()
        for n in self.nodes():
            k = len(n.key)
            assert not (n.value and n.incoming is not None), "a node in the pool and being loaded"
            if n.incoming is not None:
                assert len(n.incoming) == k and n.lock_ref > 0 and incoming.isdisjoint(n.incoming)
                assert n.parent.parent is None or n.parent.value or n.parent.incoming is not None, "load below a gap"
                incoming.update(n.incoming)
            if n.host is not None:
                assert len(n.host) == k and host_seen.isdisjoint(n.host), "host slots"
                assert n.host_ready or n.host_busy, "a host copy in flight with no op"
                host_seen.update(n.host)
                on_host.add(n)
            if n.disk is not None:
                f, off = n.disk
                assert f in self.files and n in self.files[f].nodes, "disk reference"
                assert n.disk_ready or n.disk_busy, "a disk copy in flight with no op"
                on_disk.add(n)
            assert (n.host_busy, n.disk_busy) == busy.get(n, (0, 0)), "busy counts differ from the ops in flight"
            assert n.pool_children == sum(bool(c.value) for c in n.children.values()), "children in the pool"
            if not n.value and not n.lock_ref and not n.children and not n.host_busy and not n.disk_busy:
                assert not n.hole, "a hole left as a leaf"
        assert incoming.isdisjoint(self.all_slots()) and len(incoming) == self._incoming, "loads"
        assert on_host == self._on_host and on_disk == self._on_disk, "tier sets drifted"
        self.host.check_integrity(self.host.pages_of(host_seen))
        assert all(rec.nodes for rec in self.files.values()), "a file no node refers to"
        assert self.disk_used == sum(r.nbytes for r in self.files.values()), "disk usage drifted"
        self.check_ops()
