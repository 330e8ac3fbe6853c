"""The host tier of the hierarchical KV cache: a host-memory KV pool (pinned on CUDA) and the copies
between it, the device pool and the disk tier (``disk_store.py``), run as the scheduler's
``CacheOps`` say and acknowledged by op id (``CacheAck``). The worker decides nothing: it copies.

Layout: host slot s holds token s's K and V of every layer (this rank's heads) as bytes — one row
of (2, layers, Hkv, head_dim · itemsize) — so a run of consecutive host slots is one contiguous
block (one DMA, one file write). The device pool is viewed the same way (``KVPool.tokens``).

On CUDA the copies run on their own stream, each after everything the compute stream was given
before it (a copy never races a step that writes the slots it reads): a token gather (or scatter)
through a device staging buffer and one DMA per run of host slots, timed by events.
- backup / load: overlap the steps; the scheduler learns of their end from the ack (events polled
  by the loop), and a batch lists the loads it may read (``cache_ready``): the compute stream
  waits for those (already done on rank 0; ranks > 0 may be a little behind).
- demote: its device slots were freed and may be written by the next step, so the next forward
  waits for it (``before_forward``); demotes have a stream and staging buffer of their own (high
  priority), so that wait is for the demote alone, not for the backups queued before it.
On the CPU the "device" pool is host memory too and every copy is a synchronous index copy.

``BANYAN_HICACHE_FAULTS`` (tests only): ``kind:n,...`` fails the n-th op of that kind on this rank
(backup, demote, load: a copy error; disk_write: the disk is full; disk_read: an I/O error);
``delay:n`` acknowledges every CPU copy n polls late, as a GPU's run behind the loop.
"""

from __future__ import annotations

import ctypes
import os
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from shared import knobs
from shared.config import WorkerConfig
from shared.logging import get_logger
from shared.messages.common import from_i32
from shared.messages.to_worker import CacheOp, CacheOps, CopyKind
from services.worker.disk_store import DiskStore, agree, fingerprint, runs
from services.worker.hostio import to_device
from services.worker.kv_pool import KVPool
from services.worker.tp import TPGroup

log = get_logger("worker")
STAGING_BYTES = 256 << 20  # device buffer of a copy in flight (larger copies go in chunks of it)
DEMOTE_STAGING_BYTES = 64 << 20  # the same for demotes (their own stream)


class Faults:
    """``BANYAN_HICACHE_FAULTS``: which op of a kind fails (counting from 1, on this rank)."""

    def __init__(self, spec: str) -> None:
        self.due: dict[str, set[int]] = {}
        self.seen: dict[str, int] = {}
        self.delay = 0  # ``delay:n``: every CPU copy is acknowledged n polls late (the GPU's asynchrony)
        for part in filter(None, (p.strip() for p in spec.split(","))):
            kind, _, n = part.partition(":")
            if kind == "delay":
                self.delay = int(n or 1)
                continue
            self.due.setdefault(kind, set()).add(int(n or 1))

    def __call__(self, kind: str) -> bool:
        if kind not in self.due:
            return False
        self.seen[kind] = self.seen.get(kind, 0) + 1
        return self.seen[kind] in self.due[kind]


class HostPool:
    def __init__(self, num_slots: int, bytes_per_token: int, pin: bool) -> None:
        self._unregister: weakref.finalize | None = None
        if pin:
            self.data = self._registered((num_slots, bytes_per_token))
        else:
            self.data = torch.empty((num_slots, bytes_per_token), dtype=torch.uint8)
        self.array = self.data.numpy()

    def _registered(self, shape: tuple[int, int]) -> torch.Tensor:
        """Page-locked host memory of exactly this size: torch's pinned allocator rounds every block
        up to a power of two (a 40 GiB tier would lock 64 GiB), so the memory is allocated pageable,
        touched by all cores, and registered with CUDA; torch's allocator is the fallback. The
        registration ends with the pool (``close`` or garbage collection), before the memory is
        freed: a registration outliving its memory makes the next one at that address fail."""
        data = torch.empty(shape, dtype=torch.uint8)
        try:
            data.zero_()  # (faults the pages in, in parallel: registering them is then quick)
            rt = torch.cuda.cudart()
            code = int(rt.cudaHostRegister(data.data_ptr(), data.numel(), 0))  # (an enum: 0 is success)
            if code != 0:
                _clear_cuda_error()  # (else the next kernel launch check reports it)
                raise RuntimeError(f"cudaHostRegister returned error {code}")
            self._unregister = weakref.finalize(self, _unregister, data)
            if not data.is_pinned():
                self.close()
                raise RuntimeError("the registered memory does not show as pinned")
        except Exception as e:
            log.warning("host_kv_tier_register_failed", error=f"{type(e).__name__}: {e}")
            return torch.empty(shape, dtype=torch.uint8, pin_memory=True)
        return data

    def close(self) -> None:
        if self._unregister is not None:
            self._unregister()  # (once: a finalizer runs at most once)

    @property
    def num_slots(self) -> int:
        return self.data.shape[0]


@dataclass(eq=False)
class _InFlight:
    op_id: int
    start: Any
    end: Any


class TierCopier:
    def __init__(self, kv: KVPool, host: HostPool, disk: DiskStore | None, faults: Faults | None = None) -> None:
        self.kv, self.host, self.disk = kv, host, disk
        self.tok = kv.tokens()  # (slots, 2, layers, Hkv, D·itemsize) uint8 view of the device pool
        self.row = self.tok.shape[1:]
        # the same by 8-byte words where a head's bytes allow (the GPU gather and scatter: 8× fewer
        # elements to index than bytes — by bytes, W2H's backups took SM time from every mixed step)
        self.wide, self.wide_row = self.tok, self.row
        if kv.buf.shape[-1] * kv.buf.element_size() % 8 == 0:
            self.wide = kv.buf.view(torch.int64).permute(2, 0, 1, 3, 4)
            self.wide_row = self.wide.shape[1:]
        self.faults = faults or Faults("")
        self.cuda = kv.device.type == "cuda"
        self.inflight: list[_InFlight] = []
        self.held: list[list] = []  # CPU copies whose ack waits ``faults.delay`` polls: [op id, seconds, polls]
        self.done: list[tuple[int, float]] = []
        self.failed: list[tuple[int, str]] = []
        self.loads: dict[int, Any] = {}  # load op id → its end event (``cache_ready`` waits for it)
        self.demotes: list[Any] = []  # end events the next forward waits for
        if self.cuda:
            per = host.data.shape[1]
            self.stream = torch.cuda.Stream(kv.device)
            self.staging = torch.empty((max(1, STAGING_BYTES // per), per), dtype=torch.uint8, device=kv.device)
            # demotes on a stream (and staging buffer) of their own, at high priority: the next forward
            # waits for each, and behind the backups' queue it would wait for all of theirs too (W2H)
            self.demote_stream = torch.cuda.Stream(kv.device, priority=-1)
            self.demote_staging = torch.empty((max(1, DEMOTE_STAGING_BYTES // per), per), dtype=torch.uint8,
                                              device=kv.device)

    # ---- ops -------------------------------------------------------------------------------
    def submit(self, msg: CacheOps) -> None:
        for op in msg.ops:
            try:
                if op.kind in (CopyKind.BACKUP, CopyKind.DEMOTE, CopyKind.LOAD) and self.faults(op.kind):
                    raise RuntimeError("injected fault (BANYAN_HICACHE_FAULTS)")
                self._run(op)
            except Exception as e:  # one failed copy fails its op (the scheduler recomputes), never the worker
                log.warning("kv_copy_failed", op=op.op_id, kind=op.kind, error=f"{type(e).__name__}: {e}")
                self.failed.append((op.op_id, f"copy: {type(e).__name__}: {e}"))

    def _run(self, op: CacheOp) -> None:
        host = from_i32(op.host)
        if op.kind in (CopyKind.BACKUP, CopyKind.DEMOTE, CopyKind.LOAD):
            if self.disk is not None:
                self.disk.wait_for(host)  # (a rank > 0 may still be writing or reading them)
            self._copy(op, from_i32(op.device), host)
        elif self.disk is None:
            raise RuntimeError("no disk tier on this worker")
        elif op.kind is CopyKind.DISK_WRITE:
            self.disk.write(op.op_id, op.file, op.ns, op.path, op.start, host, self._copies_so_far())
        elif op.kind is CopyKind.DISK_READ:
            self.disk.read(op.op_id, op.file, op.offset, host, self._copies_so_far())
        elif op.kind is CopyKind.DISK_DELETE:
            self.disk.delete(op.file)

    def _copy(self, op: CacheOp, dev: np.ndarray, host: np.ndarray) -> None:
        to_host = op.kind is not CopyKind.LOAD
        if op.after and self.disk is not None:
            self.disk.wait_reads(op.after)  # (rank 0 has seen them done; another rank may still be reading)
        if not self.cuda:
            t0 = time.perf_counter()
            d = torch.from_numpy(dev.astype(np.int64))
            h = torch.from_numpy(host.astype(np.int64))
            if to_host:
                self.host.data[h] = self.tok[d].reshape(len(d), -1)
            else:
                self.tok[d] = self.host.data[h].view(-1, *self.row)
            if self.faults.delay:  # (tests: acknowledged some polls later, as a GPU's copies are)
                self.held.append([op.op_id, time.perf_counter() - t0, self.faults.delay])
            else:
                self.done.append((op.op_id, time.perf_counter() - t0))
            return
        idx = to_device(dev.astype(np.int64), torch.int64, self.kv.device)  # (a writable copy of the wire's)
        marker = torch.cuda.Event()
        marker.record()  # the compute stream so far (steps that wrote or may still write these slots)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        demote = op.kind is CopyKind.DEMOTE
        stream, staging = (self.demote_stream, self.demote_staging) if demote else (self.stream, self.staging)
        with torch.cuda.stream(stream):
            stream.wait_event(marker)
            start.record(stream)
            cap = staging.shape[0]
            for a in range(0, len(dev), cap):
                b = min(len(dev), a + cap)
                stage = staging[: b - a]
                shaped = stage.view(self.wide.dtype).view(b - a, *self.wide_row)
                if to_host:
                    torch.index_select(self.wide, 0, idx[a:b], out=shaped)
                for pos, h0, n in runs(host[a:b]):
                    if to_host:
                        self.host.data[h0:h0 + n].copy_(stage[pos:pos + n], non_blocking=True)
                    else:
                        stage[pos:pos + n].copy_(self.host.data[h0:h0 + n], non_blocking=True)
                if not to_host:
                    self.wide.index_copy_(0, idx[a:b], shaped)
            end.record(stream)
        idx.record_stream(stream)
        self.inflight.append(_InFlight(op.op_id, start, end))
        if demote:
            self.demotes.append(end)
        elif op.kind is CopyKind.LOAD:
            self.loads[op.op_id] = end

    def _copies_so_far(self):
        """A wait for the copies queued so far (a disk job must not race one on the same host slots)."""
        if not self.cuda:
            return None
        events = [torch.cuda.Event(), torch.cuda.Event()]
        events[0].record(self.stream)
        events[1].record(self.demote_stream)

        def wait() -> None:
            for ev in events:
                ev.synchronize()
        return wait

    def before_forward(self, cache_ready: bytes) -> None:
        """The compute stream waits for the demotes issued so far and for the loads this batch lists."""
        if not self.cuda:
            return
        cur = torch.cuda.current_stream(self.kv.device)
        for ev in self.demotes:
            cur.wait_event(ev)
        self.demotes.clear()
        for op_id in from_i32(cache_ready).tolist():
            ev = self.loads.pop(op_id, None)
            if ev is not None:
                cur.wait_event(ev)

    # ---- acknowledgements --------------------------------------------------------------------
    def poll(self) -> tuple[list[tuple[int, float]], list[tuple[int, str]]]:
        """Ops that ended since the last poll: ([(op id, seconds)], [(op id, why it failed)])."""
        for h in self.held:
            h[2] -= 1
        self.done += [(op_id, s) for op_id, s, n in self.held if n <= 0]
        self.held = [h for h in self.held if h[2] > 0]
        still = []
        for c in self.inflight:
            if c.end.query():
                self.done.append((c.op_id, c.start.elapsed_time(c.end) / 1e3))
            else:
                still.append(c)
        self.inflight = still
        if self.disk is not None:
            for op_id, err, seconds in self.disk.poll():
                if err is None:
                    self.done.append((op_id, seconds))
                else:
                    log.warning("kv_disk_op_failed", op=op_id, error=err)
                    self.failed.append((op_id, err))
        done, failed, self.done, self.failed = self.done, self.failed, [], []
        return done, failed

    @property
    def pending(self) -> bool:
        """Copies in flight (the loop polls for their end)."""
        return bool(self.inflight or self.held) or (self.disk is not None and self.disk.pending)

    def close(self, timeout: float) -> None:
        if self.disk is not None:
            self.disk.close(timeout)
        if self.cuda:
            torch.cuda.synchronize(self.kv.device)  # (no copy may still use the host memory)
        self.host.close()


@dataclass
class Tiers:
    """What the worker has of the hierarchical cache (and tells the scheduler in ``WorkerReady``)."""

    copier: TierCopier
    host_slots: int  # usable (slot 0 is never used, as in the device pool)
    disk_capacity: int = 0  # bytes
    files: list = field(default_factory=list)  # DiskFile: what the disk holds from earlier runs
    next_file: int = 0


def build_tiers(cfg: WorkerConfig, kv: KVPool, pool_size: int, model_dir: str, tp: TPGroup, layout: dict) -> Tiers:
    """The host pool (``--hicache-size`` GiB or ``--hicache-ratio`` × the KV pool, per rank) and, with
    ``--hicache-storage-dir``, the disk tier in ``<dir>/rank<r>-of-<n>``: its files checked."""
    bpt = kv.bytes_per_token
    n = int(cfg.hicache_size * 2**30) // bpt - 1 if cfg.hicache_size else int(cfg.hicache_ratio * pool_size)
    if n < 1:
        raise ValueError(f"the host KV tier holds no token ({bpt} bytes each): raise --hicache-size or --hicache-ratio")
    free = _available_memory()
    if free is not None and (n + 1) * bpt > free:
        raise ValueError(f"the host KV tier needs {(n + 1) * bpt / 2**30:.1f} GiB of host memory and "
                         f"{free / 2**30:.1f} GiB is available: lower --hicache-size or --hicache-ratio")
    t0 = time.perf_counter()
    faults = Faults(knobs.get("hicache_faults", fresh=True))
    host = HostPool(n + 1, bpt, pin=kv.device.type == "cuda")
    disk, files, next_file = None, [], 0
    if cfg.hicache_storage_dir:
        where = os.path.join(cfg.hicache_storage_dir, f"rank{tp.rank}-of-{tp.size}")
        disk = DiskStore(where, fingerprint(model_dir, **layout), host.array, faults)
        files, next_file = disk.scan()
        if tp.size > 1:
            files, next_file = agree(files, next_file, tp, kv.device)
    log.info("host_kv_tier", tokens=n, gib=round(host.data.numel() / 2**30, 3), pinned=host.data.is_pinned(),
             seconds=round(time.perf_counter() - t0, 2), disk=disk.dir if disk else None, disk_files=len(files),
             disk_gib=cfg.hicache_storage_size if disk else 0, faults=knobs.get("hicache_faults", fresh=True) or None)
    return Tiers(TierCopier(kv, host, disk, faults), n, int(cfg.hicache_storage_size * 2**30) if disk else 0, files,
                 next_file)


def _available_memory() -> int | None:
    """Host memory the kernel says is available now (bytes), None where /proc/meminfo is not there."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _unregister(data: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(data.data_ptr())


def _clear_cuda_error() -> None:
    """Take a failed runtime call's error off the thread (``cudaGetLastError``): torch does not
    expose it, so through the CUDA runtime library torch has loaded already (best effort)."""
    major = (torch.version.cuda or "").split(".")[0]
    for name in (f"libcudart.so.{major}", "libcudart.so"):
        try:
            ctypes.CDLL(name).cudaGetLastError()
            return
        except (OSError, AttributeError):
            continue
