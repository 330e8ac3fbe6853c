"""The copies the tiered tree asks the worker for, from issue to acknowledgement (a mixin of
``TieredRadixCache``, tiers.py).

An op covers a segment of one path: the nodes from ``node`` (the lowest, fixed for the op's life)
up to depth ``top``. A node split while an op is in flight stays covered (the new upper node lies
inside the segment and inherits the busy counts), so completion walks the segment as it is then.
What an op holds while in flight, per kind (released on its ack, done or failed):

  kind         busy counts        lock   on done                       on failure
  backup       host               yes    host copy ready               host copy dropped
  demote       host               no     host copy ready               host copy dropped (maybe a hole)
  load         host               yes    ``incoming`` → ``value``      pool slots freed, host copy dropped
  disk_write   host, disk         no     disk copy ready               disk reference dropped
  disk_read    host, disk         no     host copy ready               host copy dropped, the file forgotten

A failed copy never loses anything but the copy: the node keeps its other copies, or becomes a
hole (a request that needed it recomputes those tokens).
"""

from __future__ import annotations

from shared.messages.common import i32
from shared.messages.to_worker import CacheOp, CopyKind
from services.scheduler.cache.tier_node import BUSY, LOCKS, Op, TierNode


class TierOps:
    """Uses the tree's ``counters`` (op ids go on across workers: a lost worker's late ack never
    matches), ``bytes_per_token``, ``inflight``, ``outbox``, ``to_disk`` (host copies waiting for a
    disk write) and ``disk_writes`` (in flight), set by ``TieredRadixCache.__init__``."""

    def _new_id(self) -> int:
        self.counters.cache_ops += 1
        return self.counters.cache_ops

    @staticmethod
    def segment(op: Op):
        n = op.node
        while n.depth > op.top:
            yield n
            n = n.parent

    def _start(self, kind: CopyKind, node: TierNode, top: int, tokens: int, file: int = -1, **wire) -> Op:
        op = Op(self._new_id(), kind, node, top, tokens, file)
        hb, db = BUSY[kind]
        for n in self.segment(op):
            n.host_busy += hb
            n.disk_busy += db
        if kind in LOCKS:
            self.lock(node)
        self.inflight[op.op_id] = op
        self.outbox.append(CacheOp(op_id=op.op_id, kind=kind, file=file, **wire))
        return op

    # ---- issuing ---------------------------------------------------------------------------
    def backup(self, node: TierNode) -> bool:
        """Write-through: copy a pool node to the host (it stays in the pool, locked meanwhile)."""
        host = self.alloc_host(len(node.value))
        if host is None:
            return False
        self.set_host(node, host)
        self._start(CopyKind.BACKUP, node, node.depth - len(node.key), len(host), device=i32(node.value),
                    host=i32(host))
        return True

    def demote(self, node: TierNode, slots: list[int], host: list[int]) -> None:
        self.counters.demoted_tokens += len(host)
        self._start(CopyKind.DEMOTE, node, node.depth - len(node.key), len(host), device=i32(slots), host=i32(host))

    def load(self, nodes: list[TierNode], slots: list[int]) -> Op:
        """Host → pool for ``nodes`` (top-down, consecutive, host copies ready) into ``slots``."""
        pos, host, after = 0, [], []
        for n in nodes:
            n.incoming = slots[pos:pos + len(n.key)]
            pos += len(n.key)
            host += n.host
            if n.fill_op:
                after.append(n.fill_op)
        self._incoming += len(slots)
        top = nodes[0].depth - len(nodes[0].key)
        return self._start(CopyKind.LOAD, nodes[-1], top, len(slots), device=i32(slots), host=i32(host), after=after)

    def disk_write(self, node: TierNode) -> bool:
        ns, path = self._path_key(node)
        nbytes = self.file_bytes(len(node.key), len(path))
        if not self.make_room_on_disk(nbytes) or node.host is None:  # (making room may drop its host copy)
            return False
        f = self.next_file
        self.next_file += 1
        self.add_file(node, f, 0, nbytes, ready=False)
        self.disk_writes += 1
        self._start(CopyKind.DISK_WRITE, node, node.depth - len(node.key), len(node.key), f, host=i32(node.host),
                    ns=ns, path=i32(path), start=len(path) - len(node.key))
        return True

    def disk_read(self, node: TierNode) -> bool:
        host = self.alloc_host(len(node.key))
        if host is None:
            return False
        self.set_host(node, host)
        f, off = node.disk
        op = self._start(CopyKind.DISK_READ, node, node.depth - len(node.key), len(host), f, host=i32(host), offset=off)
        node.fill_op = op.op_id
        return True

    def delete_file(self, f: int) -> None:
        self.outbox.append(CacheOp(op_id=self._new_id(), kind=CopyKind.DISK_DELETE, file=f))

    def queue_disk_write(self, node: TierNode) -> None:
        if self.disk_capacity and node.disk is None:
            self.to_disk.append(node)

    def issue_disk_writes(self, limit: int) -> None:
        while self.to_disk and self.disk_writes < limit:
            n = self.to_disk.popleft()
            if self.alive(n) and n.host_ready and n.disk is None:
                self.disk_write(n)

    def take_ops(self) -> list[CacheOp]:
        out, self.outbox = self.outbox, []
        return out

    # ---- acknowledgements ------------------------------------------------------------------
    def complete(self, op_id: int, ok: bool, reason: str = "") -> Op | None:
        """Apply a worker's answer to op ``op_id`` → the op (None: not one in flight, e.g. a delete)."""
        op = self.inflight.pop(op_id, None)
        if op is None:
            return None
        kind = op.kind
        seg = list(self.segment(op))
        hb, db = BUSY[kind]
        for n in seg:
            n.host_busy -= hb
            n.disk_busy -= db
        if kind is CopyKind.LOAD:
            for n in reversed(seg):  # top-down: a parent is in the pool before its child
                slots, n.incoming = n.incoming, None
                self._incoming -= len(slots)
                if ok:
                    self.enter_pool(n, slots)
                else:
                    self._free_slots(slots)
                    if not n.host_busy:  # (suspect: the next try reads the disk, or recomputes; but a disk
                        self.drop_host(n)  # write still reading it keeps it: a failed load wrote no host byte)
        elif kind is CopyKind.DISK_WRITE:
            self.disk_writes -= 1
            for n in seg:
                if ok:
                    n.disk_ready = True
                elif n.disk is not None:
                    self.drop_disk(n)
            if not ok and reason.startswith("disk_full"):
                self.disk_capacity = self.disk_used  # the disk holds no more than this: evict before writing
        elif kind is CopyKind.DISK_READ and not ok:
            for n in seg:
                self.drop_host(n)
            if op.file in self.files:
                self.forget_file(op.file)  # unreadable or corrupt: no node reads it again
        else:  # backup, demote, disk_read done: the host copy is what it should be
            for n in seg:
                if ok:
                    n.host_ready = True
                    if kind is not CopyKind.DISK_READ:
                        self.queue_disk_write(n)
                else:
                    self.drop_host(n)
        if kind in LOCKS:
            self.unlock(op.node)
        for n in seg:
            self.prune(n)
        return op

    # ---- checks ----------------------------------------------------------------------------
    def expected_busy(self) -> dict:
        out: dict = {}
        for op in self.inflight.values():
            hb, db = BUSY[op.kind]
            for n in self.segment(op):
                h, d = out.get(n, (0, 0))
                out[n] = (h + hb, d + db)
        return out

    def check_ops(self) -> None:
        writes = sum(op.kind is CopyKind.DISK_WRITE for op in self.inflight.values())
        assert writes == self.disk_writes, "disk writes in flight drifted"
        for op in self.inflight.values():
            assert self.alive(op.node), "an op's node left the tree"
            assert sum(len(n.key) for n in self.segment(op)) == op.tokens, "an op's segment changed size"
