"""The disk tier of the hierarchical KV cache: one file per write, written and read by two threads
of the worker (so neither the loop nor the GPU waits for the disk), between host-pool slots and
files. The scheduler decides what is written, read and deleted; the files say what they hold.

A file (``<id>.kv`` in this rank's directory): ``MAGIC``, the header length and its CRC-32, the
header (msgpack: the fingerprint of what wrote it, the cache namespace, the token ids of the path
from the namespace's root to its last token, where its own tokens start, a CRC-32 per token), then
the KV bytes token by token (``bytes_per_token`` each: K and V of every layer, this rank's heads).
Files are written under a temporary name and renamed when complete (no fsync: a crash leaves a
temporary file, swept at the next start, or a file whose checksums fail).

At start (``scan``) every file's header is checked — magic, header checksum, fingerprint, size —
and the good ones are reported to the scheduler (``WorkerReady.disk_files``), which rebuilds its
tree from them: a foreign file (another model, tokenizer, dtype or layout), a truncated or a
corrupt one is named in a warning and never loaded (nor deleted: it may be another model's). A
read checks each token's checksum before the op is acknowledged; a mismatch fails the op (the
scheduler forgets the file and deletes it; the request computes those tokens).
"""

from __future__ import annotations

import errno
import hashlib
import os
import queue
import struct
import threading
import time
import zlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import numpy as np

from shared.logging import get_logger
from shared.messages.to_scheduler import DiskFile

log = get_logger("worker")
MAGIC = b"BNYNKV01"
PREFIX = struct.Struct("<8sII")  # magic, header length, header CRC-32
FORMAT_VERSION = 1
SAMPLE = 1 << 16  # bytes of each weight file sampled into the fingerprint, at 8 places


class DiskHeader(msgspec.Struct, frozen=True):
    fingerprint: str
    ns: str
    path: bytes  # int32 token ids, root → the file's last token
    start: int  # the file holds the KV of path[start:]
    bytes_per_token: int
    crcs: bytes  # uint32 per token


class DiskError(Exception):
    """A disk op that failed; ``kind`` is the scheduler's failure label (disk_full, io, corrupt)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind


def fingerprint(model_dir: str, **layout) -> str:
    """What must match for KV written earlier to be valid now: the model's config and weights (their
    names, sizes and sampled bytes: different random weights of one shape differ), the tokenizer
    files, and ``layout`` (dtypes, KV scales, layers, heads, head size, TP rank and size)."""
    h = hashlib.sha256(f"banyan-kv-{FORMAT_VERSION}".encode())
    for name in sorted(os.listdir(model_dir)):
        p = os.path.join(model_dir, name)
        if not os.path.isfile(p):
            continue
        if name.endswith((".json", ".model", ".txt")):
            with open(p, "rb") as f:
                h.update(name.encode() + f.read())
        elif name.endswith((".safetensors", ".bin")):
            size = os.path.getsize(p)
            h.update(f"{name}:{size}".encode())
            with open(p, "rb") as f:
                for i in range(8):
                    f.seek(size * i // 8)
                    h.update(f.read(SAMPLE))
    h.update(repr(sorted(layout.items())).encode())
    return h.hexdigest()


def runs(slots: np.ndarray) -> list[tuple[int, int, int]]:
    """Consecutive stretches of ``slots``: (position in the array, first slot, length)."""
    if len(slots) == 0:
        return []
    cut = np.flatnonzero(np.diff(slots) != 1) + 1
    starts = np.concatenate([[0], cut])
    ends = np.concatenate([cut, [len(slots)]])
    return [(int(a), int(slots[a]), int(b - a)) for a, b in zip(starts, ends)]


@dataclass
class _Job:
    op_id: int
    run: Callable[[], None]
    done: threading.Event
    slots: np.ndarray | None = None  # the host slots it reads or writes


class DiskStore:
    def __init__(self, directory: str, fp: str, host: np.ndarray, faults: Callable[[str], bool] | None = None) -> None:
        self.dir = directory
        os.makedirs(directory, exist_ok=True)
        self.fp = fp
        self.host = host  # (slots, bytes_per_token) uint8: the host pool, shared with the copies
        self.bpt = host.shape[1]
        self.faults = faults or (lambda kind: False)
        self.busy = np.zeros(len(host), dtype=bool)  # host slots a queued or running job reads or writes
        self.results: queue.SimpleQueue = queue.SimpleQueue()  # (op id, error or None, seconds)
        self._reads: dict[int, threading.Event] = {}
        self._pending: deque[_Job] = deque()  # jobs not known to have ended (pruned by poll)
        self._queues = {"writer": queue.SimpleQueue(), "reader": queue.SimpleQueue()}
        self._threads = [threading.Thread(target=self._serve, args=(q,), name=f"kv-disk-{name}", daemon=True)
                         for name, q in self._queues.items()]
        for t in self._threads:
            t.start()

    def file(self, f: int) -> str:
        return os.path.join(self.dir, f"{f}.kv")

    # ---- start: what is on disk -----------------------------------------------------------
    def scan(self) -> tuple[list[DiskFile], int]:
        """(the files whose headers check out, the first id no file uses)."""
        good: list[DiskFile] = []
        top = -1
        for name in sorted(os.listdir(self.dir)):
            p = os.path.join(self.dir, name)
            if name.endswith(".tmp"):  # a write that never finished
                os.unlink(p)
                continue
            stem, _, ext = name.partition(".")
            if ext != "kv" or not stem.isdigit():
                continue
            top = max(top, int(stem))
            try:
                with open(p, "rb") as f:
                    hdr, payload_at = self._header(f, p)
            except DiskError as e:
                log.warning("kv_file_ignored", path=p, reason=str(e))
                continue
            good.append(DiskFile(file=int(stem), ns=hdr.ns, path=hdr.path, start=hdr.start, size=os.path.getsize(p)))
        return good, top + 1

    def _header(self, f, p: str) -> tuple[DiskHeader, int]:
        raw = f.read(PREFIX.size)
        if len(raw) < PREFIX.size:
            raise DiskError("corrupt", "shorter than its header")
        magic, hlen, hcrc = PREFIX.unpack(raw)
        if magic != MAGIC:
            raise DiskError("corrupt", f"not a KV file of this format ({magic!r})")
        hb = f.read(hlen)
        if len(hb) != hlen or zlib.crc32(hb) != hcrc:
            raise DiskError("corrupt", "header checksum mismatch")
        try:
            hdr = msgspec.msgpack.decode(hb, type=DiskHeader)
        except msgspec.DecodeError as e:
            raise DiskError("corrupt", f"bad header: {e}") from None
        if hdr.fingerprint != self.fp:
            raise DiskError("corrupt", "written for another model, tokenizer, dtype or layout (fingerprint differs)")
        tokens = len(hdr.path) // 4 - hdr.start
        if hdr.bytes_per_token != self.bpt or tokens <= 0 or len(hdr.crcs) != 4 * tokens:
            raise DiskError("corrupt", "header does not match this KV layout")
        at = PREFIX.size + hlen
        if os.fstat(f.fileno()).st_size != at + tokens * self.bpt:
            raise DiskError("corrupt", f"truncated or padded: {os.fstat(f.fileno()).st_size} bytes, "
                                       f"expected {at + tokens * self.bpt}")
        return hdr, at

    # ---- ops (called by the worker loop; run by the threads) ------------------------------
    def write(self, op_id: int, f: int, ns: str, path: bytes, start: int, slots: np.ndarray,
              ready: Callable[[], None] | None = None) -> None:
        """Write host ``slots`` as file ``f`` (``ready``: wait for the copies that fill them)."""
        def run() -> None:
            if ready is not None:
                ready()
            if self.faults("disk_write"):
                raise OSError(errno.ENOSPC, "injected fault (BANYAN_HICACHE_FAULTS)")
            crcs = np.fromiter((zlib.crc32(self.host[s]) for s in slots.tolist()), dtype="<u4", count=len(slots))
            hb = msgspec.msgpack.encode(DiskHeader(self.fp, ns, path, start, self.bpt, crcs.tobytes()))
            final = self.file(f)
            tmp = final + ".tmp"
            try:
                with open(tmp, "wb") as out:
                    out.write(PREFIX.pack(MAGIC, len(hb), zlib.crc32(hb)) + hb)
                    for _, s0, n in runs(slots):
                        out.write(memoryview(self.host[s0:s0 + n]))
                os.replace(tmp, final)
            except BaseException:
                if os.path.exists(tmp):
                    os.unlink(tmp)
                raise

        self._put("writer", _Job(op_id, run, threading.Event(), slots))

    def read(self, op_id: int, f: int, offset: int, slots: np.ndarray, ready: Callable[[], None] | None = None) -> None:
        """Read tokens [offset, offset + len(slots)) of file ``f`` into host ``slots``, checked
        (``ready``: wait for the copies still reading them)."""
        def run() -> None:
            if ready is not None:
                ready()
            if self.faults("disk_read"):
                raise DiskError("io", "injected fault (BANYAN_HICACHE_FAULTS)")
            p = self.file(f)
            with open(p, "rb") as src:
                hdr, at = self._header(src, p)
                crcs = np.frombuffer(hdr.crcs, dtype="<u4")
                if offset + len(slots) > len(crcs):
                    raise DiskError("corrupt", f"{p} holds {len(crcs)} tokens, not {offset + len(slots)}")
                src.seek(at + offset * self.bpt)
                for pos, s0, n in runs(slots):
                    view = memoryview(self.host[s0:s0 + n]).cast("B")
                    if src.readinto(view) != n * self.bpt:
                        raise DiskError("corrupt", f"{p} ended early")
                    for i in range(n):
                        if zlib.crc32(self.host[s0 + i]) != crcs[offset + pos + i]:
                            raise DiskError("corrupt", f"{p}: checksum mismatch at token {offset + pos + i}")

        job = _Job(op_id, run, threading.Event(), slots)
        self._reads[op_id] = job.done
        self._put("reader", job)

    def delete(self, f: int) -> None:
        def run() -> None:
            try:
                os.unlink(self.file(f))
            except FileNotFoundError:
                pass

        self._put("writer", _Job(-1, run, threading.Event()))

    def _put(self, thread: str, job: _Job) -> None:
        if job.slots is not None:
            self.wait_for(job.slots)
            self.busy[job.slots] = True
        self._pending.append(job)
        self._queues[thread].put(job)

    def wait_for(self, slots: np.ndarray) -> None:
        """Block until no job touches host ``slots``: on rank 0 the scheduler never reuses slots
        before their op's ack, but a rank > 0 may still be busy with them."""
        if len(slots) and self.busy[slots].any():
            for job in list(self._pending):
                job.done.wait()

    def wait_reads(self, op_ids: list[int]) -> None:
        """Block until these reads ended (a load on a rank > 0 that its rank 0 saw done)."""
        for i in op_ids:
            ev = self._reads.get(i)
            if ev is not None:
                ev.wait()

    def poll(self) -> list[tuple[int, str | None, float]]:
        """Ops that ended: (op id, None or why it failed, seconds)."""
        while self._pending and self._pending[0].done.is_set():
            self._pending.popleft()
        out = []
        while True:
            try:
                out.append(self.results.get_nowait())
            except queue.Empty:
                return out

    @property
    def pending(self) -> bool:
        return any(not q.empty() for q in self._queues.values()) or bool(self._reads)

    def _serve(self, q: queue.SimpleQueue) -> None:
        while True:
            job = q.get()
            if job is None:
                return
            t0 = time.perf_counter()
            err = None
            try:
                job.run()
            except DiskError as e:
                err = str(e)
            except OSError as e:
                err = f"{'disk_full' if e.errno in (errno.ENOSPC, errno.EDQUOT) else 'io'}: {e}"
            except Exception as e:  # noqa: BLE001 — any failure of one op fails that op, never the thread
                err = f"io: {type(e).__name__}: {e}"
            if job.slots is not None:
                self.busy[job.slots] = False
            job.done.set()
            self._reads.pop(job.op_id, None)
            if job.op_id >= 0:
                self.results.put((job.op_id, err, time.perf_counter() - t0))

    def close(self, timeout: float) -> None:
        """Finish the writes queued (up to ``timeout`` seconds), then stop the threads."""
        for q in self._queues.values():
            q.put(None)
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        if any(t.is_alive() for t in self._threads):
            log.warning("kv_disk_writes_unfinished", timeout_s=timeout)


def agree(files: list[DiskFile], next_file: int, tp, device) -> tuple[list[DiskFile], int]:
    """Tensor parallelism: the files every rank has (each holds its own heads' shard), and an id
    above every rank's files. Tensors through the TP group, no pickle."""
    import torch
    import torch.distributed as dist

    ids = sorted(f.file for f in files)
    top = torch.tensor([len(ids), next_file], dtype=torch.int64, device=device)
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=tp.group)
    width, nxt = int(top[0]), int(top[1])
    mine = torch.full((max(1, width),), -1, dtype=torch.int64, device=device)
    mine[: len(ids)] = torch.tensor(ids, dtype=torch.int64)
    parts = [torch.empty_like(mine) for _ in range(tp.size)]
    dist.all_gather(parts, mine, group=tp.group)
    common = set.intersection(*(set(p.tolist()) - {-1} for p in parts))
    dropped = len(ids) - len(common)
    if dropped:
        log.warning("kv_files_not_on_every_rank", ignored=dropped, rank=tp.rank)
    return [f for f in files if f.file in common], nxt
