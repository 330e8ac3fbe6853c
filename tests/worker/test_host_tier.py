"""The worker side of the hierarchical cache on the CPU: the copier moves a token's KV bytes between
the device pool, the host pool and files exactly; the disk format's checks (header, fingerprint,
size, per-token checksums) refuse what they must; failures come back as the scheduler's kinds."""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from services.worker.disk_store import DiskStore, fingerprint, runs
from services.worker.host_pool import Faults, HostPool, TierCopier
from services.worker.kv_pool import KVPool
from services.worker.quant.fp8 import FP8
from shared.messages.common import i32
from shared.messages.to_worker import CacheOp, CacheOps, CopyKind


def pool(kv_dtype=None) -> KVPool:
    p = KVPool(3, 33, 2, 8, torch.float32, "cpu", kv_dtype=kv_dtype)
    g = torch.Generator().manual_seed(0)
    for t in p.k + p.v:
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
    return p


def token_bytes(p: KVPool, slots) -> list[bytes]:
    return [bytes(p.tokens()[s].contiguous().view(-1).numpy()) for s in slots]


def op(op_id, kind, device=(), host=(), **kw) -> CacheOp:
    return CacheOp(op_id=op_id, kind=kind, device=i32(list(device)), host=i32(list(host)), **kw)


@pytest.mark.parametrize("kv_dtype", [None, FP8])
def test_copies_move_each_tokens_bytes(kv_dtype) -> None:
    p = pool(kv_dtype)
    host = HostPool(20, p.bytes_per_token, pin=False)
    c = TierCopier(p, host, None)
    before = token_bytes(p, [3, 9, 4])
    c.submit(CacheOps([op(1, CopyKind.BACKUP, [3, 9, 4], [5, 6, 7]), op(2, CopyKind.DEMOTE, [4], [12])]))
    c.submit(CacheOps([op(3, CopyKind.LOAD, [30, 31, 32], [5, 6, 7])]))  # (host slots back into other pool slots)
    done, failed = c.poll()
    assert [i for i, _ in done] == [1, 2, 3] and not failed and all(s >= 0 for _, s in done)
    assert token_bytes(p, [30, 31, 32]) == before and bytes(host.array[12]) == before[2]
    k, v = p.read(1, torch.tensor([31]))  # the model reads the loaded token like any other
    k0, v0 = p.read(1, torch.tensor([9]))
    assert torch.equal(k, k0) and torch.equal(v, v0)


def test_a_failing_copy_fails_its_op_only() -> None:
    p = pool()
    c = TierCopier(p, HostPool(8, p.bytes_per_token, pin=False), None, Faults("load:1"))
    c.submit(CacheOps([op(1, CopyKind.BACKUP, [1], [1]), op(2, CopyKind.LOAD, [2], [1]),
                       op(3, CopyKind.LOAD, [4], [99])]))  # (host slot 99 does not exist)
    done, failed = c.poll()
    assert [i for i, _ in done] == [1] and [i for i, _ in failed] == [2, 3]
    assert all(r.startswith("copy: ") for _, r in failed) and "injected" in failed[0][1]


def test_runs_of_slots() -> None:
    assert runs(np.array([4, 5, 6, 9, 2, 3])) == [(0, 4, 3), (3, 9, 1), (4, 2, 2)]
    assert runs(np.array([], dtype=np.int32)) == []


def store(tmp_path: Path, fp: str = "fp", faults=None) -> tuple[DiskStore, HostPool]:
    host = HostPool(16, 24, pin=False)
    host.array[:] = np.arange(16 * 24, dtype=np.uint8).reshape(16, 24) % 251
    return DiskStore(str(tmp_path), fp, host.array, faults), host


def write_and_wait(d: DiskStore, op_id: int, f: int, slots, path=(1, 2, 3, 4), start=1) -> tuple[int, str | None]:
    d.write(op_id, f, "ns", i32(list(path)), start, np.array(slots, dtype=np.int32))
    return next(r for r in _drain(d))[:2]


def _drain(d: DiskStore, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for r in d.poll():
            yield r
        time.sleep(0.005)


def test_disk_round_trip_and_restart_scan(tmp_path) -> None:
    d, host = store(tmp_path)
    want = host.array[[7, 8, 2]].copy()
    assert write_and_wait(d, 1, 5, [7, 8, 2]) == (1, None)
    d.read(2, 5, 1, np.array([10, 11], dtype=np.int32))  # tokens 1..2 of the file
    assert next(_drain(d))[:2] == (2, None)
    assert (host.array[[10, 11]] == want[1:]).all()
    d.close(5)
    d2, _ = store(tmp_path)
    files, nxt = d2.scan()
    assert [(f.file, f.ns, f.start) for f in files] == [(5, "ns", 1)] and nxt == 6
    assert files[0].size == os.path.getsize(tmp_path / "5.kv")
    d2.close(5)


def test_scan_ignores_foreign_truncated_and_unfinished_files(tmp_path, caplog) -> None:
    d, _ = store(tmp_path)
    for f in (1, 2, 3):
        assert write_and_wait(d, f, f, [f, f + 1, f + 2]) == (f, None)
    d.close(5)
    (tmp_path / "2.kv").write_bytes((tmp_path / "2.kv").read_bytes()[:-1])
    (tmp_path / "4.kv.tmp").write_bytes(b"x")
    (tmp_path / "7.kv").write_bytes(b"not a kv file at all, long enough to hold a prefix")
    other, _ = store(tmp_path, fp="another model")
    files, nxt = other.scan()
    assert files == [] and nxt == 8  # (ids never reused: 7 is taken, if only by a bad file)
    ours, _ = store(tmp_path)
    files, _ = ours.scan()
    assert [f.file for f in files] == [1, 3] and not (tmp_path / "4.kv.tmp").exists()
    assert (tmp_path / "2.kv").exists() and (tmp_path / "7.kv").exists()  # ignored, never deleted
    other.close(5)
    ours.close(5)


def test_a_corrupt_payload_is_never_loaded(tmp_path) -> None:
    d, host = store(tmp_path)
    assert write_and_wait(d, 1, 0, [3, 4, 5]) == (1, None)
    raw = bytearray((tmp_path / "0.kv").read_bytes())
    raw[-30] ^= 1  # a bit of the middle token (24 bytes a token)
    (tmp_path / "0.kv").write_bytes(bytes(raw))
    host.array[12:15] = 0
    d.read(2, 0, 0, np.array([12, 13, 14], dtype=np.int32))
    op_id, err, _ = next(_drain(d))
    assert op_id == 2 and err.startswith("corrupt: ") and "token 1" in err
    os.unlink(tmp_path / "0.kv")
    d.read(3, 0, 0, np.array([12], dtype=np.int32))
    op_id, err, _ = next(_drain(d))
    assert op_id == 3 and err.startswith("io: ")  # (gone: unreadable)
    d.close(5)


def test_disk_full_is_reported_as_such(tmp_path, monkeypatch) -> None:
    """ENOSPC from the file system (here from os.replace, the last step of a write) → disk_full, no
    file left behind; the next write goes through."""
    d, _ = store(tmp_path)
    real = os.replace
    calls = []

    def full(a, b):
        calls.append(b)
        if len(calls) == 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(a, b)

    monkeypatch.setattr(os, "replace", full)
    op_id, err = write_and_wait(d, 1, 0, [1, 2, 3])
    assert op_id == 1 and err.startswith("disk_full: ") and not list(tmp_path.iterdir())
    assert write_and_wait(d, 2, 1, [1, 2, 3]) == (2, None)
    d.close(5)
    injected, _ = store(tmp_path / "x", faults=Faults("disk_write:1"))
    assert write_and_wait(injected, 3, 0, [1])[1].startswith("disk_full: ")
    injected.close(5)


def test_fingerprint_tells_weights_and_layouts_apart(tmp_path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    for d, seed in ((a, 0), (b, 1)):
        d.mkdir()
        (d / "config.json").write_text('{"hidden_size": 8}')
        (d / "model.safetensors").write_bytes(np.random.default_rng(seed).bytes(1 << 18))
    assert fingerprint(str(a), tp=(0, 1)) == fingerprint(str(a), tp=(0, 1))
    assert fingerprint(str(a), tp=(0, 1)) != fingerprint(str(b), tp=(0, 1))  # same shape, other weights
    assert fingerprint(str(a), tp=(0, 1)) != fingerprint(str(a), tp=(1, 2))
    assert fingerprint(str(a), kv_dtype="bf16") != fingerprint(str(a), kv_dtype="fp8")


def test_a_host_tier_larger_than_memory_is_refused_with_the_numbers() -> None:
    from services.worker.host_pool import _available_memory, build_tiers
    from services.worker.tp import TPGroup
    from shared.config import WorkerConfig

    free = _available_memory()
    assert free is not None  # (Linux: /proc/meminfo)
    cfg = WorkerConfig(hicache_size=2 * free / 2**30 + 1)
    with pytest.raises(ValueError, match=r"host memory .* available: lower --hicache-size"):
        build_tiers(cfg, pool(), 32, "unused", TPGroup(), {})
