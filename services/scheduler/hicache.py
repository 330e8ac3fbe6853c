"""The hierarchical KV cache, scheduler side: brings a waiting request's cached prefix back into the
pool before its prefill, issues the tier copies, applies the worker's acknowledgements. The tree
(``cache/tiers.py``) says where each node's KV is; this decides when to move it.

- Fetch: when the batcher considers a waiting request (``KVManager.ready``), the nodes of its
  prefix beyond the pool are walked; if they hold at least ``MIN_LOAD_TOKENS`` tokens the request
  is kept aside (skipped by the batcher, never blocking the loop) with its path locked while disk
  files are read into host memory, then host memory is copied into the pool (one load per fetch, a
  copy stream on the GPU). Once acknowledged the request is admitted like any other: its match now
  covers those tokens. Loads in flight for requests not yet admitted stay under ``budget`` tokens.
  A copy that fails leaves the tokens uncached: the request computes them.
- Write-through (default): every node inserted into the pool is copied to the host at once (the
  copy overlaps the steps); evicting it from the pool then costs nothing. Write-back copies a node
  out only when the pool evicts it (the next forward waits for that copy).
- Disk: host copies are written to files in the order they became ready, ``MAX_DISK_WRITES`` at a
  time, and read back through the host. After a restart the worker reports the files whose headers
  check out (``WorkerReady.disk_files``) and they are hung back into the tree (``restore``).

Everything is counted in ``Counters`` (tier hits, tokens and seconds per direction, failures).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from shared.logging import get_logger
from shared.messages.common import from_f32, from_i32, i32
from shared.messages.to_scheduler import CacheAck, WorkerReady
from shared.messages.to_worker import CacheOps, CopyKind
from services.scheduler.batcher import Scheduled
from services.scheduler.cache.tiers import TieredRadixCache, TierNode
from services.scheduler.counters import Counters
from services.scheduler.kv import KVManager
from services.scheduler.memory import SlotAllocator
from services.scheduler.request import Req, Status

log = get_logger("scheduler")
MIN_LOAD_TOKENS = 32  # a shorter prefix beyond the pool is recomputed: the copy's round trip costs more
MAX_FETCHES = 256  # requests kept aside at once (more wait their turn in the queue)
MAX_DISK_WRITES = 8  # files being written at once (host copies wait in order for their turn)
DIRECTIONS = {CopyKind.BACKUP: "device_to_host", CopyKind.DEMOTE: "device_to_host", CopyKind.LOAD: "host_to_device",
              CopyKind.DISK_WRITE: "host_to_disk", CopyKind.DISK_READ: "disk_to_host"}


@dataclass(eq=False)
class Fetch:
    """A waiting request whose prefix is being brought back into the pool. Until it starts (budget
    permitting) it holds nothing; then its path is locked until it is admitted or leaves the queue."""

    req: Req
    since: float
    handle: TierNode | None = None  # the deepest node of its prefix, once started
    pooled: int = 0  # then: tokens of its prefix in the pool …
    tiers: list[tuple[str, int]] = field(default_factory=list)  # … and the rest, top-down, by tier
    claimed: int = 0  # tokens of the budget it holds (its nodes out of the pool)
    done: bool = False


class HiCache:
    def __init__(self, kv: KVManager, tree: TieredRadixCache, counters: Counters, write_back: bool,
                 budget: int, min_load: int = MIN_LOAD_TOKENS) -> None:
        self.kv, self.tree, self.slots, self.counters = kv, tree, kv.slots, counters
        self.write_back = write_back
        self.budget = budget
        self.min_load = min_load
        self.fetches: dict[Req, Fetch] = {}
        self.loading = 0  # tokens being read, loaded or loaded for requests not admitted yet (the budget)
        self.deferred = 0  # requests kept aside this step without a fetch (too many fetches)
        self.acked_loads: list[int] = []  # load ops acknowledged since the last batch (``cache_ready``)
        self.fetch_waits: list[float] = []  # seconds requests were kept aside (metrics drain it)

    @classmethod
    def attach(cls, kv: KVManager, w: WorkerReady, counters: Counters, write_back: bool,
               budget: int, min_load: int = MIN_LOAD_TOKENS) -> HiCache:
        """Give ``kv`` a tiered tree sized from the worker's host pool and disk, with what the disk
        already holds."""
        tree = TieredRadixCache(kv.slots.free, kv.page_size, SlotAllocator(w.host_pool_size, kv.page_size),
                                write_back, w.disk_capacity, w.kv_bytes_per_token, w.disk_next_file, counters)
        kv.cache = tree
        h = kv.hicache = cls(kv, tree, counters, write_back, budget, min_load)
        kept = 0
        for f in sorted(w.disk_files, key=lambda f: (f.start, -len(f.path))):  # (what holds a file's prefix first)
            if tree.restore(f.ns, from_i32(f.path).tolist(), f.start, f.file, f.size):
                kept += 1
            else:
                tree.delete_file(f.file)
        log.info("hicache_ready", host_tokens=tree.host.pool_size, write_policy="write_back" if write_back else
                 "write_through", disk_bytes=w.disk_capacity, disk_files=len(w.disk_files), restored=kept,
                 restored_bytes=tree.disk_used)
        return h

    # ---- fetching ----------------------------------------------------------------------------
    def ready(self, r: Req) -> bool:
        """May the batcher admit ``r`` now? False while its prefix is coming back into the pool."""
        f = self.fetches.get(r)
        if f is not None:
            return f.done
        if self._plan(r) is None:
            return True
        if len(self.fetches) >= MAX_FETCHES:
            self.deferred += 1
            return False
        f = self.fetches[r] = Fetch(r, time.monotonic())
        self._advance(f)
        return f.done

    def _plan(self, r: Req) -> tuple[list[TierNode], int, list[tuple[str, int]]] | None:
        """(the nodes of ``r``'s prefix out of the pool, the tokens in it, the rest by tier), or None
        when fewer than ``min_load`` tokens lie beyond the pool."""
        key = r.prefix_key()
        nodes = self.tree.path_nodes(r.ns, key)
        i = next((k for k, n in enumerate(nodes) if not n.value), len(nodes))
        end = len(key) - len(key) % self.kv.page_size
        tiers = [("host" if n.host is not None or n.incoming is not None else "disk",
                  min(len(n.key), end - (n.depth - len(n.key)))) for n in nodes[i:]]
        if sum(t for _, t in tiers) < self.min_load:
            return None
        return nodes[i:], nodes[i].depth - len(nodes[i].key), tiers

    def admitted(self, r: Req) -> None:
        """``r`` was admitted (its match taken and locked): its fetch ends; the tokens its match got
        beyond what was in the pool count as hits of the tier they came from."""
        f = self.fetches.pop(r, None)
        if f is None:
            return
        gained = len(r.slots) - f.pooled
        for tier, n in f.tiers:
            n = min(n, gained)
            if n <= 0:
                break
            if tier == "host":
                self.counters.host_hit_tokens += n
            else:
                self.counters.disk_hit_tokens += n
            gained -= n
        self.fetch_waits.append(time.monotonic() - f.since)
        self._end(f)

    def _end(self, f: Fetch) -> None:
        self.loading -= f.claimed
        if f.handle is not None:
            self.tree.unlock(f.handle)

    def step(self) -> None:
        """Once per loop: advance the fetches, drop those of requests that left the queue."""
        self.deferred = 0
        for r, f in list(self.fetches.items()):
            if r.status is not Status.WAITING:  # (finished while it waited: aborted, failed)
                del self.fetches[r]
                self._end(f)
            elif not f.done:
                self._advance(f)

    def _advance(self, f: Fetch) -> None:
        if f.handle is None and not self._start(f):
            return
        nodes: list[TierNode] = []  # its path's nodes out of the pool, top-down
        n = f.handle
        while n.parent is not None and not n.value:
            nodes.append(n)
            n = n.parent
        nodes.reverse()
        if not nodes or any(n.hole for n in nodes):  # all in the pool; or a copy failed: compute the rest
            f.done = True
            return
        if any(n.incoming is not None or (n.host is not None and not n.host_ready) for n in nodes):
            return  # a copy of its own, or of another fetch sharing the prefix, is in flight
        for n in nodes:
            if n.host is None and not (n.disk_ready and self.tree.disk_read(n)):
                return  # the host tier is full of copies in use: next time
        if any(not n.host_ready for n in nodes):
            return
        slots = self._alloc_pool(sum(len(n.key) for n in nodes))
        if slots is not None:
            self.tree.load(nodes, slots)

    def _start(self, f: Fetch) -> bool:
        """Plan ``f`` again (what is where may have changed while it waited), claim the budget for
        its nodes out of the pool and lock its path; False: not now (over budget), or done."""
        plan = self._plan(f.req)
        if plan is None:
            f.done = True
            return False
        nodes, pooled, tiers = plan
        claim = sum(len(n.key) for n in nodes)
        if self.loading and self.loading + claim > self.budget:
            return False
        self.tree.lock(nodes[-1])
        f.handle, f.pooled, f.tiers, f.claimed = nodes[-1], pooled, tiers, claim
        self.loading += claim
        return True

    def _alloc_pool(self, n: int) -> list[int] | None:
        need = self.slots.tokens_needed(None, n)
        if need > self.slots.num_free:
            self.counters.evicted_tokens += self.tree.evict(need - self.slots.num_free)
        return self.slots.alloc(None, n) if need <= self.slots.num_free else None

    def blocked(self) -> int:
        """Waiting requests the batcher cannot admit until a copy ends."""
        return self.deferred + sum(not f.done for f in self.fetches.values())

    # ---- talking to the worker ---------------------------------------------------------------
    def flush(self, send: Callable[[CacheOps], None], sched: Scheduled | None, all_writes: bool = False) -> None:
        """Issue the copies due (write-through backups, disk writes) and send every op queued since
        the last call — before the batch, which may depend on them; tell the batch which loads it
        may read (``cache_ready``)."""
        tree = self.tree
        if not self.write_back:
            for n in tree.fresh:
                if n.value and n.host is None and tree.alive(n):
                    tree.backup(n)
        tree.fresh.clear()
        tree.issue_disk_writes(len(tree.to_disk) + tree.disk_writes if all_writes else MAX_DISK_WRITES)
        out = tree.take_ops()
        if out:
            send(CacheOps(ops=out))
        if sched is not None and self.acked_loads:
            sched.msg = msgspec.structs.replace(sched.msg, cache_ready=i32(self.acked_loads))
            self.acked_loads = []

    def on_ack(self, ack: CacheAck) -> None:
        c, book = self.counters, self.tree
        for op_id, seconds in zip(from_i32(ack.done).tolist(), from_f32(ack.seconds).tolist()):
            op = book.complete(op_id, True)
            if op is not None:
                d = DIRECTIONS[op.kind]
                c.tier_tokens[d] = c.tier_tokens.get(d, 0) + op.tokens
                c.tier_seconds[d] = c.tier_seconds.get(d, 0.0) + seconds
                if op.kind is CopyKind.LOAD:
                    self.acked_loads.append(op_id)
        for op_id, reason in zip(from_i32(ack.failed).tolist(), ack.reasons):
            op = book.complete(op_id, False, reason)
            if op is not None:
                kind = reason.split(":", 1)[0]
                c.tier_failures[kind] = c.tier_failures.get(kind, 0) + 1
                log.warning("hicache_copy_failed", op=op_id, kind=op.kind, tokens=op.tokens, reason=reason)
                if op.kind is CopyKind.LOAD:
                    self.acked_loads.append(op_id)

    @property
    def in_flight(self) -> int:
        return len(self.tree.inflight)


def tier_load(c: Counters, h: HiCache | None) -> dict:
    """GetLoad's fields of the tiers (``Load``): prompt tokens each served, their size and use,
    tokens copied each way, failed copies."""
    out = dict(host_cached_tokens=c.host_hit_tokens, disk_cached_tokens=c.disk_hit_tokens,
               tier_stored_tokens=c.tier_tokens.get("device_to_host", 0),
               tier_loaded_tokens=c.tier_tokens.get("host_to_device", 0),
               disk_written_tokens=c.tier_tokens.get("host_to_disk", 0),
               disk_read_tokens=c.tier_tokens.get("disk_to_host", 0), tier_failures=sum(c.tier_failures.values()))
    if h is not None:
        t = h.tree
        out.update(host_pool_tokens=t.host.pool_size, host_used_tokens=t.host_used, disk_capacity_bytes=t.disk_capacity,
                   disk_used_bytes=t.disk_used)
    return out
