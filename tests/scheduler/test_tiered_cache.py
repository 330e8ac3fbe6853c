"""The hierarchical cache's scheduler side (``TieredRadixCache`` + ``HiCache`` + ``KVManager``): a
stateful property test against a fake worker that moves KV *contents* between tiers, then unit tests
of the paths it must take (demote and load back, write-through, disk read, failures, restore).

The fake worker's "KV" of a token is a hash of its namespace and every token up to it, as the real
KV depends on the whole prefix. Copies move those values when the test decides to run them (any
time between issue and acknowledgement; a demote before the next "forward", as the worker orders
it), and every copy the tree calls ready — in the pool, on the host, on disk — must hold exactly
the values of the tokens its node stands for; so must every matched prefix a request starts from.
As the real worker, the fake fails a read of a file deleted since it was asked for (the scheduler
forgets a whole file when a read of one part of it fails, while a read of another part may be in
flight): a read that finds its file gone fails, whatever the test would have said.
"""

from __future__ import annotations

import itertools

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from services.scheduler.cache.tiers import TieredRadixCache
from services.scheduler.counters import Counters
from services.scheduler.hicache import HiCache
from services.scheduler.kv import KVManager
from services.scheduler.memory import OutOfSlots
from services.scheduler.request import Req, Status
from shared.messages.common import SamplingParams, f32, from_i32, i32
from shared.messages.to_scheduler import CacheAck, DiskFile, WorkerReady
from shared.messages.to_worker import CopyKind

ALPHA = st.integers(0, 2)
BPT = 16  # bytes per token (file sizes in the disk budget)
GARBAGE = "garbage"


def kv_of(ns: str, path, i: int) -> int:
    return hash((ns, tuple(path[: i + 1])))


def ready_msg(pool: int, host: int, disk: int, files=(), next_file: int = 0) -> WorkerReady:
    return WorkerReady(model="m", architecture="a", vocab_size=8, context_length=4096, pool_size=pool,
                       eos_token_ids=[], device="cpu", dtype="float32", host_pool_size=host, kv_bytes_per_token=BPT,
                       disk_capacity=disk, disk_files=list(files), disk_next_file=next_file)


class FakeWorker:
    """Device, host and disk contents, and the ops the scheduler sent (run or not yet)."""

    def __init__(self) -> None:
        self.dev: dict[int, object] = {}
        self.host: dict[int, object] = {}
        self.files: dict[int, tuple[str, list[int], int, list]] = {}  # id → (ns, path, start, values)
        self.ops: dict[int, object] = {}  # sent, not acknowledged
        self.ran: set[int] = set()
        self.failing: set[int] = set()  # ran and failed whatever the test says (a read of a deleted file)

    def send(self, msg) -> None:
        for op in msg.ops:
            if op.kind is CopyKind.DISK_DELETE:
                self.files.pop(op.file, None)
                continue
            self.ops[op.op_id] = op
            if op.kind is CopyKind.DEMOTE:  # its pool slots are free: the worker copies before the next forward
                self.run(op.op_id)

    def run(self, op_id: int) -> None:
        op = self.ops[op_id]
        if op_id in self.ran:
            return
        self.ran.add(op_id)
        dev, host = from_i32(op.device).tolist(), from_i32(op.host).tolist()
        if op.kind in (CopyKind.BACKUP, CopyKind.DEMOTE):
            for d, h in zip(dev, host):
                self.host[h] = self.dev.get(d, GARBAGE)
        elif op.kind is CopyKind.LOAD:
            for d, h in zip(dev, host):
                self.dev[d] = self.host.get(h, GARBAGE)
        elif op.kind is CopyKind.DISK_WRITE:
            values = [self.host.get(h, GARBAGE) for h in host]
            self.files[op.file] = (op.ns, from_i32(op.path).tolist(), op.start, values)
        elif op.kind is CopyKind.DISK_READ and op.file not in self.files:
            # deleted since (a read of another part failed and the scheduler forgot the file): the
            # worker's read fails (its open does; one opened before the unlink still reads the data)
            self.failing.add(op_id)
        elif op.kind is CopyKind.DISK_READ:
            vals = self.files[op.file][3]
            for i, h in enumerate(host):
                self.host[h] = vals[op.offset + i] if op.offset + i < len(vals) else GARBAGE

    def spoil(self, op_id: int) -> None:
        """A copy that ran and then failed (checksum, short read): its destination holds garbage."""
        op = self.ops[op_id]
        if op_id in self.ran and op.kind in (CopyKind.BACKUP, CopyKind.DEMOTE, CopyKind.DISK_READ):
            for h in from_i32(op.host).tolist():
                self.host[h] = GARBAGE
        if op_id in self.ran and op.kind is CopyKind.LOAD:
            for d in from_i32(op.device).tolist():
                self.dev[d] = GARBAGE


class TierMachine(RuleBasedStateMachine):
    @initialize(P=st.sampled_from([1, 2]), pages=st.integers(12, 40), host=st.sampled_from([0.5, 1.0, 3.0]),
                write_back=st.booleans(), disk=st.sampled_from([0, 2500, 10**7]))
    def setup(self, P: int, pages: int, host: float, write_back: bool, disk: int) -> None:
        self.P, self.pool, self.write_back, self.disk = P, pages * P + P - 1, write_back, disk
        self.host_size = max(P, int(host * self.pool))
        self.worker = FakeWorker()
        self.rids = itertools.count()
        self._start(ready_msg(self.pool, self.host_size, disk))

    def _start(self, w: WorkerReady) -> None:
        self.counters = Counters()
        self.kv = KVManager(w.pool_size, 8, self.P, True, self.counters)
        self.h = HiCache.attach(self.kv, w, self.counters, self.write_back, budget=24, min_load=self.P)
        self.tree: TieredRadixCache = self.kv.cache
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.keys: list[list[int]] = [[]]
        self.flush()

    # ---- helpers -----------------------------------------------------------------------------
    def flush(self) -> None:
        self.h.flush(self.worker.send, None)

    def settle(self) -> None:
        """Every op in flight (and those their acks cause) runs and ends well."""
        self.flush()
        while self.worker.ops:
            for op_id in sorted(self.worker.ops):
                self.worker.run(op_id)
                self._ack(op_id, op_id not in self.worker.failing, "io: gone")
            self.flush()

    def draw_key(self, data) -> list[int]:
        base = data.draw(st.sampled_from(self.keys), label="base")
        cut = data.draw(st.integers(0, len(base)), label="cut")
        key = base[:cut] + data.draw(st.lists(ALPHA, min_size=1, max_size=48 - cut), label="tail")
        if len(self.keys) < 48:
            self.keys.append(key)
        return key

    def compute(self, r: Req, start: int) -> None:
        """The forward writes the KV of r's positions [start, len(slots))."""
        for i in range(start, len(r.slots)):
            self.worker.dev[r.slots[i]] = kv_of(r.ns, r.seq, i)

    # ---- rules -------------------------------------------------------------------------------
    @rule(data=st.data(), ns=st.sampled_from(["", "b"]))
    def arrive(self, data, ns: str) -> None:
        """A request arrives; the next step's batcher considers it."""
        key = self.draw_key(data)
        r = Req(rid=str(next(self.rids)), replica=b"", prompt=key + [7], params=SamplingParams(max_new_tokens=4), ns=ns)
        self.waiting.append(r)
        self._consider(r, data)

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def consider(self, data) -> None:
        self._consider(data.draw(st.sampled_from(self.waiting)), data)

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def loop_until_admitted(self, data) -> None:
        """Loop iterations with every copy ending well, until a waiting request is admitted."""
        r = data.draw(st.sampled_from(self.waiting))
        for _ in range(4):
            self._consider(r, data)
            if r not in self.waiting:
                return
            self.settle()

    def _consider(self, r: Req, data) -> None:
        """A loop iteration: fetches advance, then the batcher considers ``r``: admitted (match,
        compute the rest) when ready."""
        self.h.step()
        ready = self.kv.ready(r)
        self.flush()
        if not ready or self.kv.rows.num_free == 0:
            return
        self.waiting.remove(r)
        self.kv.admit(r)
        assert [self.worker.dev.get(s) for s in r.slots] == [kv_of(r.ns, r.seq, i) for i in range(len(r.slots))], \
            "a matched prefix holds the wrong KV"
        r.status = Status.RUNNING
        self.running.append(r)
        start = len(r.slots)
        try:
            self.kv.extend(r, r.to_compute)
        except OutOfSlots:
            self.flush()
            self.running.remove(r)
            self.kv.release(r, keep=False)
            r.status = Status.FINISHED
            return
        self.flush()  # (evictions may have demoted: those copies run before the forward)
        self.compute(r, start)
        if data.draw(st.booleans(), label="cache prefix"):
            self.kv.cache_prefix(r)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), keep=st.booleans())
    def finish(self, data, keep: bool) -> None:
        r = data.draw(st.sampled_from(self.running))
        if keep and data.draw(st.booleans(), label="decode"):
            r.output.append(data.draw(ALPHA))  # one decoded token, computed before the release
            try:
                start = len(r.slots)
                self.kv.extend(r, 1)
                self.flush()
                self.compute(r, start)
            except OutOfSlots:
                r.output.pop()
        self.running.remove(r)
        self.kv.release(r, keep=keep)
        r.status = Status.FINISHED
        self.flush()

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def abort_waiting(self, data) -> None:
        r = data.draw(st.sampled_from(self.waiting))
        self.waiting.remove(r)
        r.status = Status.FINISHED

    @rule()
    def step(self) -> None:
        self.h.step()
        self.flush()

    @precondition(lambda self: self.worker.ops)
    @rule(data=st.data())
    def run_op(self, data) -> None:
        self.worker.run(data.draw(st.sampled_from(sorted(self.worker.ops))))

    @precondition(lambda self: self.worker.ops)
    @rule(data=st.data(), ok=st.sampled_from([True, True, True, False]),
          reason=st.sampled_from(["copy: injected", "disk_full: no space", "corrupt: checksum", "io: gone"]))
    def ack(self, data, ok: bool, reason: str) -> None:
        op_id = data.draw(st.sampled_from(sorted(self.worker.ops)))
        if ok:
            self.worker.run(op_id)
        self._ack(op_id, ok and op_id not in self.worker.failing, reason if not ok else "io: gone")
        self.flush()

    def _ack(self, op_id: int, ok: bool, reason: str) -> None:
        """The worker's answer to ``op_id``: done, or failed (what it wrote is garbage)."""
        if ok:
            self.h.on_ack(CacheAck(done=i32([op_id]), seconds=f32([0.001])))
        else:
            self.worker.spoil(op_id)
            self.h.on_ack(CacheAck(failed=i32([op_id]), reasons=[reason]))
        del self.worker.ops[op_id]

    @rule()
    def all_copies_end(self) -> None:
        self.settle()

    @rule(k=st.integers(0, 60), tier=st.sampled_from(["device", "host", "disk"]))
    def evict(self, k: int, tier: str) -> None:
        if tier == "device":
            self.tree.evict(k)
        elif tier == "host":
            self.tree.evict_host(k)
        else:
            self.tree.evict_disk(k * BPT)
        self.flush()

    @precondition(lambda self: self.disk)
    @rule()
    def restart(self) -> None:
        """The worker restarts: pools and ops gone; what reached the disk is reported and restored."""
        w = self.worker
        files = [DiskFile(f, ns, i32(path), start, self.tree.file_bytes(len(path) - start, len(path)))
                 for f, (ns, path, start, _) in w.files.items()]
        w.dev.clear(), w.host.clear(), w.ops.clear(), w.ran.clear(), w.failing.clear()
        self._start(ready_msg(self.pool, self.host_size, self.disk, files, max(w.files, default=-1) + 1))

    # ---- invariants --------------------------------------------------------------------------
    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "tree"):
            return
        self.kv.check_integrity(self.running)
        w = self.worker
        for n in self.tree.nodes():
            ns, path = self.tree._path_key(n)
            start = n.depth - len(n.key)
            want = [kv_of(ns, path, start + i) for i in range(len(n.key))]
            assert not n.value or [w.dev.get(s) for s in n.value] == want, "pool copy"
            assert not n.host_ready or [w.host.get(s) for s in n.host] == want, "host copy"
            if n.disk is not None and n.disk_ready:
                f, off = n.disk
                assert w.files[f][3][off:off + len(n.key)] == want, "disk copy"
        for r in self.running:
            assert [w.dev.get(s) for s in r.slots] == [kv_of(r.ns, r.seq, i) for i in range(len(r.slots))]

    def teardown(self) -> None:
        if not hasattr(self, "tree"):
            return
        for r in list(self.running):
            self.running.remove(r)
            self.kv.release(r)
        for r in self.waiting:
            r.status = Status.FINISHED
        self.h.step()
        self.settle()
        self.kv.check_integrity([])
        assert not self.h.fetches and self.tree.locked_size == 0 and self.h.loading == 0
        for evict in (self.tree.evict, self.tree.evict_host, self.tree.evict_disk):  # (pool → host → disk)
            evict(10**12)
            self.settle()
        self.kv.check_integrity([])
        assert self.kv.slots.num_free == self.kv.pool_size and self.tree.host_used == 0
        assert not list(self.tree.nodes()) and self.tree.disk_used == 0


TestTierMachine = TierMachine.TestCase
TestTierMachine.settings = settings(max_examples=150, stateful_step_count=100, deadline=None,
                                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
