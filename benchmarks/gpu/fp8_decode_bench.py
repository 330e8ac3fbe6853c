"""Decode attention over an FP8 pool (issue 20: FP8 KV no slower than bf16): FlashInfer's
tensor-core decode on a bf16 pool and on an FP8 one against Banyan's Triton split-KV kernel
(``services/worker/attention/triton_decode.py``) on both, by batch size and context, each replayed
from a CUDA graph and reading another layer's cache per call (8 cycled, as 32 layers do). The
8B shape: 32 query / 8 KV heads, head_dim 128, page size 1 (slots in random order).

    python -m benchmarks.gpu.fp8_decode_bench --out $OUT/fp8_decode.json [--shapes 64x1024,600x1536]
    python -m benchmarks.gpu.fp8_decode_bench --out D --shapes 96x2560 --spread 0.9 --splits 1,2,4,8 \
      --min-parts 0,256,512
    (W2's ~90-row decodes: contexts 256-2,560 — does one split a request leave the longest ones as a tail?)

Also checks the Triton kernel against FlashInfer on the same FP8 cache (max abs difference).
Prints a table last (µs a layer, % of 4.3 TB/s); writes JSON."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

HQ, HKV, D, LAYERS = 32, 8, 128, 8  # (the 8B shape's heads; a call reads another of 8 layers' caches, as 32 do)


def graph_time(fn, calls: int = 8, reps: int = 10) -> float:
    """µs per ``fn(i)`` call (i = 0..calls-1), replayed from one CUDA graph (the small-M tuner's timer)."""
    from services.worker.kernels.small_m import _time

    return _time(fn, calls, reps) * 1e6


SHAPES = "1x1024,1x8192,16x2048,64x1024,256x1536,600x1536,1024x1024"
CONFIGS = ((64, 4, 2, False, "cvt"), (64, 4, 3, False, "cvt"), (64, 4, 2, True, "cvt"), (64, 4, 3, True, "cvt"),
           (64, 4, 3, True, "int"), (64, 4, 3, True, "asm"), (64, 4, 4, True, "asm"), (32, 4, 3, True, "asm"),
           (64, 8, 3, True, "asm"), (128, 4, 3, True, "asm"), (128, 4, 3, True, "cvt"), (64, 2, 3, True, "asm"))
# (block, warps, stages, products in fp16, how an FP8 pool's values are widened: triton_decode.widen_mode)
HBM = 4.3e12


def run(shapes: list[tuple[int, int]], spread: float = 0.0, splits: tuple[int, ...] = (),
        min_parts: tuple[int, ...] = (0,), only: str = "") -> list[dict]:
    import re

    import flashinfer

    from services.worker.attention import triton_decode as td

    dev, rows = torch.device("cuda"), []
    ws = torch.zeros(512 << 20, dtype=torch.uint8, device=dev)  # (256 MiB overflowed at 1,024 × 288)
    scale = 1 / math.sqrt(D)
    for bs, ctx in shapes:
        slots = bs * ctx + 1
        bf = [(torch.randn(slots, HKV, D, dtype=torch.bfloat16, device=dev),
               torch.randn(slots, HKV, D, dtype=torch.bfloat16, device=dev)) for _ in range(LAYERS)]
        f8 = [(k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)) for k, v in bf]
        table = (torch.randperm(slots - 1, device=dev)[: bs * ctx].to(torch.int32) + 1).view(bs, ctx)
        rows_dev = torch.arange(bs, device=dev)
        # contexts: all ``ctx``, or with ``spread`` uniform in [ctx (1 - spread), ctx] (W2's requests differ)
        lens = torch.randint(max(1, int(ctx * (1 - spread))), ctx + 1, (bs,)) if spread else torch.full((bs,), ctx)
        prefix = (lens - 1).to(dev)
        indptr = torch.zeros(bs + 1, dtype=torch.int32)
        indptr[1:] = lens.cumsum(0)
        perm = torch.cat([table[i, : int(n)] for i, n in enumerate(lens.tolist())])
        q = torch.randn(bs, HQ, D, dtype=torch.bfloat16, device=dev)
        row: dict = {"batch": bs, "context": ctx, "spread": spread, "mean_context": float(lens.float().mean())}
        for name, caches, kv_dtype in (("bf16", bf, torch.bfloat16), ("fp8", f8, torch.float8_e4m3fn)):
            w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                ws, "NHD", use_cuda_graph=True, use_tensor_cores=True, paged_kv_indptr_buffer=indptr.to(dev),
                paged_kv_indices_buffer=perm.clone(),
                paged_kv_last_page_len_buffer=torch.ones(bs, dtype=torch.int32, device=dev))
            w.plan(indptr, perm, torch.ones(bs, dtype=torch.int32), HQ, HKV, D, 1, q_data_type=torch.bfloat16,
                   kv_data_type=kv_dtype)
            kw = dict(k_scale=0.5, v_scale=2.0) if name == "fp8" else {}
            row[f"flashinfer_{name}_us"] = round(graph_time(lambda i, w=w, c=caches, kw=kw: w.run(q, c[i], **kw),
                                                            LAYERS), 2)
            for block, warps, stages, f16, widen in CONFIGS:
                if widen != "cvt" and name != "fp8" or name == "bf16" and warps != 4:
                    continue  # (widening is an FP8 pool's)
                key = f"triton_{name}_{block}_{warps}w{stages}s{'_f16' if f16 else ''}{'_' + widen if f16 else ''}_us"
                if only and not re.search(only, key):
                    continue
                try:
                    row[key] = round(graph_time(lambda i, c=caches, b=block, nw=warps, ns=stages, h=f16, wm=widen:
                                                td.decode(q, c[i][0], c[i][1], table, rows_dev, prefix, scale, 0.5,
                                                          2.0, block=b, num_warps=nw, num_stages=ns, f16=h, widen=wm),
                                                LAYERS), 2)
                except Exception as e:  # (a configuration that does not compile: recorded)
                    row[key] = f"{type(e).__name__}: {e}"[:120]
            key = f"triton_{name}_served_us"  # (what the flashinfer backend launches: ``launch_config``'s choice)
            if not only or re.search(only, key):
                row[key] = round(graph_time(lambda i, c=caches, h=name == "fp8": td.decode(
                    q, c[i][0], c[i][1], table, rows_dev, prefix, scale, 0.5, 2.0, f16=h), LAYERS), 2)
            key = f"triton_{name}_served_rope_us"  # (the same with the rope and the new K/V write inside: decodes')
            if not only or re.search(only, key):
                kn, vn = (torch.randn(bs, HKV, D, dtype=torch.bfloat16, device=dev) for _ in range(2))
                inv = torch.full((HKV,), 2.0, device=dev) if name == "fp8" else None
                new = (kn, vn, torch.randn(ctx, D, device=dev), prefix, table[:, -1].to(torch.int64), inv, inv)
                try:
                    row[key] = round(graph_time(lambda i, c=caches, h=name == "fp8", nw=new: td.decode(
                        q, c[i][0], c[i][1], table, rows_dev, prefix, scale, 0.5, 2.0, f16=h, new=nw), LAYERS), 2)
                except Exception as e:  # (recorded, as a configuration that does not compile)
                    row[key] = f"{type(e).__name__}: {e}"[:120]
            for n, part in ((n, part) for n in splits for part in min_parts
                            if not only or re.search(only, f"triton_{name}_served_{n}splits")):
                # the served configuration at other split counts, with parts of at least ``part`` tokens
                row[f"triton_{name}_served_{n}splits_min{part}_us"] = round(graph_time(
                    lambda i, c=caches, n=n, m=part, h=name == "fp8": td.decode(
                        q, c[i][0], c[i][1], table, rows_dev, prefix, scale, 0.5, 2.0, splits=n, f16=h, min_part=m),
                    LAYERS), 2)
            if name == "fp8":  # the decode steps' variant: the rope and the new token's K/V write inside
                kn, vn = (torch.randn(bs, HKV, D, dtype=torch.bfloat16, device=dev) for _ in range(2))
                inv = torch.full((HKV,), 2.0, device=dev)
                new = (kn, vn, torch.randn(ctx, D, device=dev), prefix, table[:, -1].to(torch.int64), inv, inv)
                for block, widen in ((64, "cvt"), (128, "cvt"), (64, "asm"), (128, "asm")):
                    key = f"triton_fp8_{block}_4w3s_f16_{widen}_rope_us"
                    if only and not re.search(only, key):
                        continue
                    try:
                        row[key] = round(graph_time(
                            lambda i, c=caches, b=block, wm=widen: td.decode(
                                q, c[i][0], c[i][1], table, rows_dev, prefix, scale, 0.5, 2.0, block=b, num_stages=3,
                                f16=True, widen=wm, new=new), LAYERS), 2)
                    except Exception as e:
                        row[key] = f"{type(e).__name__}: {e}"[:120]
                ref = w.run(q, caches[0], k_scale=0.5, v_scale=2.0).float()
                got = td.decode(q, caches[0][0], caches[0][1], table, rows_dev, prefix, scale, 0.5, 2.0).float()
                row["triton_vs_flashinfer_fp8_max_abs"] = float((got - ref).abs().max())
                got = td.decode(q, caches[0][0], caches[0][1], table, rows_dev, prefix, scale, 0.5, 2.0, f16=True,
                                widen="cvt")
                row["triton_f16_vs_flashinfer_fp8_max_abs"] = float((got.float() - ref).abs().max())
                row["ref_max_abs"] = float(ref.abs().max())
                for widen in ("int", "asm"):  # (exact: the same products as the conversion's, 2^8 apart)
                    other = td.decode(q, caches[0][0], caches[0][1], table, rows_dev, prefix, scale, 0.5, 2.0,
                                      f16=True, widen=widen)
                    row[f"{widen}_vs_cvt_max_abs"] = float((other.float() - got.float()).abs().max())
        for name, size in (("bf16", 2), ("fp8", 1)):
            times = {k: v for k, v in row.items() if k.startswith(f"triton_{name}_") and isinstance(v, float)}
            row[f"triton_{name}_best_us"] = min(times.values()) if times else None
            row[f"triton_{name}_best"] = min(times, key=times.get) if times else None
            row[f"{name}_bytes"] = int(lens.sum()) * HKV * D * 2 * size
        rows.append(row)
        print(json.dumps(row), flush=True)
        del bf, f8
        torch.cuda.empty_cache()
    return rows


def table(rows: list[dict]) -> str:
    out = ["| batch × context | FlashInfer bf16 µs (% BW) | FlashInfer FP8 | Triton bf16 best | Triton FP8 best | "
           "Triton − FlashInfer FP8 max abs |", "| --- | ---: | ---: | ---: | ---: | ---: |"]

    def cell(us, nbytes):
        return f"{us:.1f} ({nbytes / (us * 1e-6) / HBM:.0%})" if isinstance(us, float) else str(us)

    for r in rows:
        out.append(f"| {r['batch']} × {r['context']} | {cell(r['flashinfer_bf16_us'], r['bf16_bytes'])} | "
                   f"{cell(r['flashinfer_fp8_us'], r['fp8_bytes'])} | {cell(r['triton_bf16_best_us'], r['bf16_bytes'])}"
                   f" | {cell(r['triton_fp8_best_us'], r['fp8_bytes'])} `{r['triton_fp8_best']}` | "
                   f"{r['triton_vs_flashinfer_fp8_max_abs']:.3g} "
                   f"(of {r['ref_max_abs']:.3g}) |")
    return "\n".join(out)


def splits_table(rows: list[dict]) -> str:
    """µs a layer of the served configurations at each ``--splits`` count (min part 0) beside FlashInfer's."""
    counts = sorted({int(k.split("_")[3].removesuffix("splits")) for r in rows for k in r if "splits_min0" in k})
    out = ["| batch × context | pool | FlashInfer | Triton served | "
           + " | ".join(f"{n} splits" for n in counts) + " |",
           "| --- | --- | ---: | ---: |" + " ---: |" * len(counts)]
    for r in rows:
        for name in ("bf16", "fp8"):
            got = [r.get(f"triton_{name}_served_{n}splits_min0_us") for n in counts]
            if any(isinstance(v, float) for v in got):
                out.append(f"| {r['batch']} × {r['context']} | {name} | {r[f'flashinfer_{name}_us']} | "
                           f"{r.get(f'triton_{name}_served_us')} | " + " | ".join(str(v) for v in got) + " |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--shapes", default=SHAPES, help="batch x context, comma-separated")
    ap.add_argument("--spread", type=float, default=0.0, help="contexts uniform in [context (1 - spread), context]")
    ap.add_argument("--splits", default="", help="also time the served configurations (bf16, FP8) at these split "
                    "counts")
    ap.add_argument("--min-parts", default="0", help="with --splits: the kernel's min_part values to time")
    ap.add_argument("--only", default="", help="time only the Triton variants whose key matches this regex")
    a = ap.parse_args()
    shapes = [tuple(int(x) for x in s.split("x")) for s in a.shapes.split(",")]
    rows = run(shapes, a.spread, tuple(int(n) for n in a.splits.split(",") if n),
               tuple(int(n) for n in a.min_parts.split(",")), a.only)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"rows": rows, "configs": CONFIGS}, indent=1))
    print(table(rows))
    if a.splits:
        print(splits_table(rows))


if __name__ == "__main__":
    main()
