"""The hierarchical cache's scheduler side, path by path: the batcher keeps a request aside while its
prefix is loaded (admitting others meanwhile) and the batch that may read the load lists it; write-back
demotes on eviction with the pool slots free at once; a load that fails leaves the request to compute;
a node split while its copy is in flight; the disk index restored after a restart (orphans,
duplicates and misaligned files deleted); disk full shrinks the budget; with the tier off nothing
of it runs."""

from __future__ import annotations

from collections import deque

from services.scheduler.batcher import Batcher, Limits
from services.scheduler.cache import RadixCache
from services.scheduler.cache.tiers import TieredRadixCache
from services.scheduler.counters import Counters
from services.scheduler.hicache import MIN_LOAD_TOKENS, HiCache
from services.scheduler.kv import KVManager
from services.scheduler.memory import SlotAllocator
from services.scheduler.policy import FCFS
from services.scheduler.request import Req, Status
from shared.messages.common import SamplingParams, f32, from_i32, i32
from shared.messages.to_scheduler import CacheAck, DiskFile, WorkerReady
from shared.messages.to_worker import CopyKind

BPT = 8


def worker_ready(pool: int, host: int, disk: int = 0, files=(), next_file: int = 0) -> WorkerReady:
    return WorkerReady(model="m", architecture="a", vocab_size=100, context_length=4096, pool_size=pool,
                       eos_token_ids=[], device="cpu", dtype="float32", host_pool_size=host, kv_bytes_per_token=BPT,
                       disk_capacity=disk, disk_files=list(files), disk_next_file=next_file)


def tiered(pool=255, host=512, write_back=False, disk=0, files=(), next_file=0,
           min_load=MIN_LOAD_TOKENS) -> tuple[KVManager, HiCache, list]:
    kv = KVManager(pool, 8, 1, True, Counters())
    h = HiCache.attach(kv, worker_ready(pool, host, disk, files, next_file), kv.counters, write_back, budget=256,
                       min_load=min_load)
    return kv, h, []


def req(rid: str, prompt: list[int], new: int = 4) -> Req:
    return Req(rid=rid, replica=b"", prompt=prompt, params=SamplingParams(max_new_tokens=new, temperature=0.0))


def flush(h: HiCache, sent: list, sched=None) -> list:
    h.flush(lambda m: sent.extend(m.ops), sched)
    out = list(sent)
    sent.clear()
    return out


def ack(h: HiCache, ops, ok: bool = True, reason: str = "copy: boom") -> None:
    ids = [o.op_id for o in ops]
    h.on_ack(CacheAck(done=i32(ids), seconds=f32([0.001] * len(ids))) if ok else
             CacheAck(failed=i32(ids), reasons=[reason] * len(ids)))


def serve_once(kv: KVManager, r: Req) -> None:
    """Admit, compute the whole prompt, finish: its KV goes into the tree."""
    kv.admit(r)
    kv.extend(r, r.to_compute)
    r.status = Status.RUNNING
    kv.release(r)
    r.status = Status.FINISHED


def test_a_request_waits_aside_while_its_prefix_loads() -> None:
    kv, h, sent = tiered()
    prefix = list(range(1, 161))
    serve_once(kv, req("a", prefix + [500]))
    backups = flush(h, sent)
    assert {o.kind for o in backups} == {CopyKind.BACKUP}  # write-through: copied as it entered the pool
    ack(h, backups)
    assert kv.cache.evict(10**6) == 161 and kv.cache.host_used == 161 and not flush(h, sent)  # (no copy: backed up)

    b, c = req("b", prefix + [7, 8]), req("c", [900 + i for i in range(40)])
    waiting, running = deque([b, c]), []
    batcher = Batcher(kv, FCFS(), Limits(8, 4096, 4096))
    first = batcher.build(running, waiting)
    ops = flush(h, sent, first)
    assert [r.rid for r in first.reqs] == ["c"] and list(waiting) == [b]  # b kept aside, c admitted meanwhile
    (load,) = ops  # (whole nodes: the first request's last token too)
    assert load.kind is CopyKind.LOAD and len(from_i32(load.device)) == 161 and not first.msg.cache_ready
    assert not batcher.build(running, waiting) or list(waiting) == [b]  # still loading: still aside
    flush(h, sent)
    ack(h, [load])
    h.step()
    second = batcher.build(running, waiting)
    flush(h, sent, second)
    assert [r.rid for r in second.reqs] == ["c", "b"] and b.cached_tokens == 160  # (c decodes)
    assert from_i32(second.msg.cache_ready).tolist() == [load.op_id]  # the batch waits for the load
    assert from_i32(second.msg.new_reqs[0].prefix_slots).tolist() == from_i32(load.device).tolist()[:160]
    assert second.msg.extend_lens == i32([1, 2]) and kv.counters.host_hit_tokens == 160
    kv.check_integrity(running)


def test_write_back_demotes_on_eviction_and_frees_the_pool_at_once() -> None:
    kv, h, sent = tiered(write_back=True)
    serve_once(kv, req("a", list(range(1, 41))))
    assert not flush(h, sent)  # nothing copied while in the pool
    free = kv.slots.num_free
    assert kv.cache.evict(40) == 40 and kv.slots.num_free == free + 40
    (demote,) = flush(h, sent)
    assert demote.kind is CopyKind.DEMOTE and len(from_i32(demote.host)) == 40
    kv.check_integrity([])
    ack(h, [demote])
    assert kv.counters.tier_tokens == {"device_to_host": 40}
    kv.check_integrity([])


def test_a_host_smaller_than_the_pool_demotes_only_over_older_copies() -> None:
    """W2H's shape (write-through, a host tier smaller than the pool): a node whose host copy the
    full host already dropped for a newer one leaves the pool with no copy (a demote would make the
    next forward wait, only to drop something more recently used); a node used since is demoted,
    over the older copy."""
    kv, h, sent = tiered(host=48)
    a, b = list(range(1, 41)), list(range(100, 140))
    serve_once(kv, req("a", a))
    ack(h, flush(h, sent))
    serve_once(kv, req("b", b))  # its backup makes room by dropping a's host copy (a is older)
    ack(h, flush(h, sent))
    tree: TieredRadixCache = kv.cache
    assert [n.host is not None for n in sorted(tree.nodes(), key=lambda n: n.key[0])] == [False, True]
    assert tree.evict(10**6) == 80 and not flush(h, sent)  # a dropped, b kept on the host: no copy
    assert kv.counters.demoted_tokens == 0 and tree.host_used == 40
    kv.check_integrity([])

    serve_once(kv, req("c", list(range(200, 240))))
    ack(h, flush(h, sent))  # c's backup drops b's host copy
    kv.cache.match("", list(range(200, 240)))  # c used again: newer than anything on the host
    serve_once(kv, req("d", list(range(300, 340))))
    ack(h, flush(h, sent))  # d's backup drops c's host copy (c still in the pool)
    kv.cache.match("", list(range(200, 240)))
    assert kv.cache.evict(10**6) == 80
    (demote,) = flush(h, sent)  # d leaves the pool (on the host), c is demoted over d's older copy
    assert demote.kind is CopyKind.DEMOTE and len(from_i32(demote.host)) == 40 and kv.counters.demoted_tokens == 40
    ack(h, [demote])
    kv.check_integrity([])


def test_write_through_copies_again_what_the_host_dropped_while_in_use() -> None:
    """A prefix whose host copy a small host dropped while its request ran (W2H: requests outlive the
    host's turnover) is backed up again when the request's KV goes back into the tree, so its eviction
    later frees the pool with no copy the next forward would wait for."""
    kv, h, sent = tiered(host=48)
    a = req("a", list(range(1, 41)))
    kv.admit(a)
    kv.extend(a, a.to_compute)
    a.status = Status.RUNNING
    kv.cache_prefix(a)  # (chunked prefill: what it computed is in the tree, backed up)
    ack(h, flush(h, sent))
    serve_once(kv, req("b", list(range(100, 140))))  # meanwhile: b's backup drops a's host copy
    ack(h, flush(h, sent))
    tree: TieredRadixCache = kv.cache
    assert tree.host_used == 40 and all(n.host is None for n in tree.nodes() if n.key[0] == 1)
    kv.release(a)
    a.status = Status.FINISHED
    again = flush(h, sent)
    assert [o.kind for o in again] == [CopyKind.BACKUP] and len(from_i32(again[0].device)) == 40
    ack(h, again)
    assert tree.evict(10**6) == 80 and not flush(h, sent) and kv.counters.demoted_tokens == 0
    kv.check_integrity([])


def test_a_failed_load_leaves_the_request_to_compute() -> None:
    kv, h, sent = tiered()
    serve_once(kv, req("a", list(range(1, 101))))
    ack(h, flush(h, sent))
    kv.cache.evict(10**6)
    b = req("b", list(range(1, 101)) + [5])
    assert not kv.ready(b)
    (load,) = flush(h, sent)
    ack(h, [load], ok=False)
    h.step()
    assert kv.ready(b)  # the host copy is suspect and dropped: nothing left to load
    kv.admit(b)
    assert b.cached_tokens == 0 and kv.counters.tier_failures == {"copy": 1} and kv.counters.host_hit_tokens == 0
    kv.check_integrity([])


def test_a_failed_load_keeps_a_host_copy_a_disk_write_still_reads() -> None:
    """A load from a host copy that a disk write is still reading fails: the host copy stays until
    that write ends (its slots are not reused under it), and the file then holds the right KV."""
    kv, h, sent = tiered(disk=10**6)
    serve_once(kv, req("a", list(range(1, 41))))
    ack(h, flush(h, sent))  # backed up
    (write,) = flush(h, sent)
    assert write.kind is CopyKind.DISK_WRITE
    kv.cache.evict(10**6)
    b = req("b", list(range(1, 41)) + [5])
    assert not kv.ready(b)
    (load,) = flush(h, sent)
    assert load.kind is CopyKind.LOAD and from_i32(load.host).tolist() == from_i32(write.host).tolist()
    ack(h, [load], ok=False)
    tree: TieredRadixCache = kv.cache
    (node,) = tree.nodes()
    assert node.host == from_i32(write.host).tolist() and tree.host_used == 40  # kept: the write reads it
    kv.check_integrity([])
    ack(h, [write])
    assert node.disk_ready and kv.counters.tier_failures == {"copy": 1}
    kv.check_integrity([])


def test_a_node_split_while_its_copy_is_in_flight() -> None:
    kv, h, sent = tiered()
    serve_once(kv, req("a", list(range(1, 61))))
    (backup,) = flush(h, sent)
    kv.cache.match("", list(range(1, 31)))  # splits the node the backup covers
    kv.check_integrity([])
    ack(h, [backup])
    tree: TieredRadixCache = kv.cache
    assert sorted(len(n.key) for n in tree.nodes()) == [30, 30] and all(n.host_ready for n in tree.nodes())
    kv.check_integrity([])


def test_restart_restores_the_disk_index() -> None:
    files = [DiskFile(0, "", i32(list(range(10))), 0, 600),  # tokens 0..9
             DiskFile(1, "", i32(list(range(16))), 10, 600),  # 10..15 under it
             DiskFile(2, "", i32([0, 1, 2, 99, 98]), 3, 600),  # 99, 98 after 0, 1, 2 (a split of file 0's node)
             DiskFile(3, "", i32(list(range(12))), 10, 600),  # duplicate of part of file 1
             DiskFile(4, "", i32([50, 51, 52]), 2, 600),  # its prefix (50, 51) is nowhere: an orphan
             DiskFile(5, "t", i32([7, 7]), 0, 600)]  # another namespace
    kv, h, sent = tiered(disk=10**6, files=files, next_file=6, min_load=1)
    tree: TieredRadixCache = kv.cache
    deleted = sorted(o.file for o in flush(h, sent) if o.kind is CopyKind.DISK_DELETE)
    assert deleted == [3, 4] and sorted(tree.files) == [0, 1, 2, 5] and tree.disk_used == 4 * 600
    assert [len(n) for n in (tree.path_nodes("", list(range(16))), tree.path_nodes("", [0, 1, 2, 99, 98]))] == [3, 2]
    b = req("b", list(range(16)) + [1])
    assert not kv.ready(b)
    reads = flush(h, sent)
    assert sorted((o.file, o.offset, len(from_i32(o.host))) for o in reads) == [(0, 0, 3), (0, 3, 7), (1, 0, 6)]
    kv.check_integrity([])
    ack(h, reads)
    h.step()  # the host copies are ready: one load for the three nodes, after the reads on every rank
    (load,) = flush(h, sent)
    assert load.kind is CopyKind.LOAD and sorted(load.after) == sorted(o.op_id for o in reads)
    ack(h, [load])
    h.step()
    assert kv.ready(b)
    kv.admit(b)
    assert b.cached_tokens == 16 and kv.counters.disk_hit_tokens == 16 and kv.counters.host_hit_tokens == 0
    kv.check_integrity([b])
    assert tree.next_file == 6


def test_disk_full_shrinks_the_budget_to_what_is_used() -> None:
    kv, h, sent = tiered(disk=10**6)
    serve_once(kv, req("a", list(range(1, 31))))
    ack(h, flush(h, sent))  # backup done → a disk write queued
    (write,) = flush(h, sent)
    assert write.kind is CopyKind.DISK_WRITE and kv.cache.disk_used > 0
    ack(h, [write], ok=False, reason="disk_full: No space left on device")
    tree: TieredRadixCache = kv.cache
    assert tree.disk_used == 0 and tree.disk_capacity == 0 and kv.counters.tier_failures == {"disk_full": 1}
    deletes = flush(h, sent)
    assert [o.kind for o in deletes] == [CopyKind.DISK_DELETE]  # (whatever part of it was written)
    kv.check_integrity([])


def test_tier_off_runs_nothing_of_it() -> None:
    kv = KVManager(255, 8, 1, True, Counters())
    assert type(kv.cache) is RadixCache and kv.hicache is None and kv.ready(req("x", [1, 2, 3]))
    host = SlotAllocator(64, 1)
    assert host.pool_size == 64


class Events(list):
    """A cache listener recording (what, namespace, tokens)."""

    def stored(self, ns, key, start, end) -> None:
        self.append(("stored", ns, list(key[start:end])))

    def removed(self, ns, key, start, end) -> None:
        self.append(("removed", ns, list(key[start:end])))


def test_kv_events_see_a_prefix_while_any_tier_holds_it() -> None:
    kv, h, sent = tiered(disk=10**6)
    tree: TieredRadixCache = kv.cache
    tree.listener = ev = Events()
    serve_once(kv, req("a", list(range(1, 41))))
    assert ev == [("stored", "", list(range(1, 41)))]
    ack(h, flush(h, sent))  # backup
    ack(h, flush(h, sent))  # disk write
    kv.cache.evict(10**6)  # out of the pool: still cached (host, disk)
    tree.evict_host(10**6)  # off the host: still on disk
    assert len(ev) == 1 and sorted(tree.walk())[0][2] == list(range(1, 41))
    assert tree.flush() == 0 and ev[-1] == ("removed", "", list(range(1, 41)))  # (FlushCache: every tier)
    assert [o.kind for o in flush(h, sent)] == [CopyKind.DISK_DELETE] and not list(tree.nodes())
    kv.check_integrity([])
