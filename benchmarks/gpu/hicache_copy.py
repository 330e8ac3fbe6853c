"""The host tier's copies on one GPU (one H200 call): GB/s of backups (pool → pinned host) and loads
(host → pool) of scattered pool slots, per op size, through the copier the worker uses, and what
the copies cost a compute stream running GEMMs meanwhile (the overlap the design relies on).
Llama-3.1-8B KV shape (32 layers, 8 KV heads, 128, bf16: 128 KiB a token). Prints a table, writes JSON.

    python -m benchmarks.gpu.hicache_copy --out /tmp/banyan-gpu/hicache_copy.json      # ~1 min
    python -m benchmarks.gpu.hicache_copy --cpu-smoke                                  # the code path, tiny
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[2])]

from services.worker.host_pool import HostPool, TierCopier  # noqa: E402
from services.worker.kv_pool import KVPool  # noqa: E402
from shared.messages.common import i32  # noqa: E402
from shared.messages.to_worker import CacheOp, CacheOps, CopyKind  # noqa: E402


def wait(c: TierCopier, op_id: int) -> float:
    while True:
        done, failed = c.poll()
        if failed:
            raise RuntimeError(failed)
        for i, s in done:
            if i == op_id:
                return s


def check_bytes(pool: KVPool, c: TierCopier, n: int, hn: int, rng: random.Random) -> dict:
    """Back up slots spread over the whole pool (its last ones too), scribble over them, load them
    back: every byte must return (one op of each kind, 1,024 tokens)."""
    size = min(1024, hn, n)
    dev = sorted(rng.sample(range(1, n + 1), size - 2) + [n, n - 1])
    host_slots = list(range(hn - size + 1, hn + 1))  # (the host pool's end)
    tok = pool.tokens()
    idx = torch.tensor(dev, device=tok.device)
    tok[idx] = torch.randint(0, 256, (size, *tok.shape[1:]), dtype=torch.uint8, device=tok.device)
    want = tok[idx].clone()
    c.submit(CacheOps([CacheOp(op_id=10**6, kind=CopyKind.BACKUP, device=i32(dev), host=i32(host_slots))]))
    wait(c, 10**6)
    tok[idx] = 0
    c.submit(CacheOps([CacheOp(op_id=10**6 + 1, kind=CopyKind.LOAD, device=i32(dev), host=i32(host_slots))]))
    wait(c, 10**6 + 1)
    if tok.device.type == "cuda":
        torch.cuda.synchronize()
    return {"tokens": size, "pool_bytes": tok.numel(), "equal": bool(torch.equal(tok[idx], want))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=65536, help="pool and host slots")
    ap.add_argument("--sizes", default="128,1024,8192,32768", help="tokens per op")
    ap.add_argument("--out", default="/tmp/banyan-gpu/hicache_copy.json")
    ap.add_argument("--host-tokens", type=int, default=0, help="host slots (default: --tokens)")
    ap.add_argument("--verify", action="store_true", help="also check the bytes: slots near the pool's end "
                    "backed up, overwritten, loaded back (a pool of the W2 server's size is > 100 GB)")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU (the code path only)")
    a = ap.parse_args()
    device = "cpu" if a.cpu_smoke else "cuda"
    layers, heads, dim = (2, 2, 16) if a.cpu_smoke else (32, 8, 128)
    n = 2048 if a.cpu_smoke else a.tokens
    pool = KVPool(layers, n + 1, heads, dim, torch.bfloat16, device)
    hn = min(n, a.host_tokens) if a.host_tokens else n
    host = HostPool(hn + 1, pool.bytes_per_token, pin=device == "cuda")
    c = TierCopier(pool, host, None)
    rng = random.Random(0)
    rows, op_id = [], 0
    verified = None
    if a.verify:
        verified = check_bytes(pool, c, n, hn, rng)
        print(f"verify: {verified}", flush=True)
    for size in (int(x) for x in a.sizes.split(",")):
        size = min(size, hn)
        for kind in (CopyKind.BACKUP, CopyKind.LOAD):
            secs = []
            for _ in range(5):
                op_id += 1
                dev = rng.sample(range(1, n + 1), size)
                start = rng.randrange(1, hn + 2 - size)
                host_slots = i32(range(start, start + size))
                c.submit(CacheOps([CacheOp(op_id=op_id, kind=kind, device=i32(dev), host=host_slots)]))
                secs.append(wait(c, op_id))
            best = min(secs)
            rows.append({"kind": str(kind), "tokens": size, "ms": best * 1e3,
                         "gb_s": size * pool.bytes_per_token / best / 1e9})
    overlap = {}
    if device == "cuda":  # GEMMs alone, then with a backup and a load of the largest size running beside them
        x = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)

        def gemms() -> float:
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(50):
                x @ x
            torch.cuda.synchronize()
            return time.perf_counter() - t

        gemms()
        alone = gemms()
        size = min(max(int(s) for s in a.sizes.split(",")), hn)
        c.submit(CacheOps([CacheOp(op_id=op_id + 1, kind=CopyKind.BACKUP, device=i32(range(1, size + 1)),
                                   host=i32(range(1, size + 1))),
                           CacheOp(op_id=op_id + 2, kind=CopyKind.LOAD, device=i32(range(1, size + 1)),
                                   host=i32(range(1, size + 1)))]))
        beside = gemms()
        overlap = {"gemm_s_alone": alone, "gemm_s_with_copies": beside, "slowdown": beside / alone - 1,
                   "copied_tokens": 2 * size}
    doc = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "bytes_per_token":
           pool.bytes_per_token, "pool_tokens": n, "host_tokens": hn, "verified": verified, "rows": rows,
           "overlap": overlap}
    print(f"{'op':<8} {'tokens':>8} {'ms':>9} {'GB/s':>8}")
    for r in rows:
        print(f"{r['kind']:<8} {r['tokens']:>8} {r['ms']:>9.3f} {r['gb_s']:>8.2f}")
    if overlap:
        print(f"GEMMs: {overlap['gemm_s_alone'] * 1e3:.1f} ms alone, {overlap['gemm_s_with_copies'] * 1e3:.1f} ms "
              f"with {overlap['copied_tokens']} tokens copied beside them ({100 * overlap['slowdown']:+.1f} %)")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(doc, indent=1))
    print(f"results: {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
