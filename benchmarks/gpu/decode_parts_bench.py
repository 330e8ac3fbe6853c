"""Two parts of a decode step measured apart (issue 18: W1's non-GEMM time), each replayed from a
CUDA graph as a decode step runs them:

- decode attention (FlashInfer, page size 1, the 8B shape's 32 query / 8 KV heads, head_dim 128):
  the tensor-core kernel (``use_tensor_cores=True``, what Banyan uses for GQA groups ≥ 4) against
  the CUDA-core one, by batch size and context length, under ``use_cuda_graph=True`` wrappers;
  each call reads another layer's cache (8 cycled), as 32 layers do;
- greedy token choice over a 128,256-token vocabulary: ``argmax`` against a two-stage max (the
  vocabulary in chunks: each chunk's max, then the best chunk: the same first-maximum index).

    python -m benchmarks.gpu.decode_parts_bench --out $OUT/decode_parts.json

Prints a table last; writes JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

HQ, HKV, D, LAYERS = 32, 8, 128, 8


def graph_time(fn, calls: int = 8, reps: int = 10) -> float:
    """µs per ``fn(i)`` call (i = 0..calls-1), replayed from one CUDA graph (the small-M tuner's timer)."""
    from services.worker.kernels.small_m import _time

    return _time(fn, calls, reps) * 1e6


def attention_rows(batches: list[int], contexts: list[int]) -> list[dict]:
    import flashinfer

    dev = torch.device("cuda")
    rows = []
    ws = torch.zeros(256 << 20, dtype=torch.uint8, device=dev)
    for ctx in contexts:
        slots = max(batches) * ctx
        caches = [(torch.randn(slots, HKV, D, dtype=torch.bfloat16, device=dev),
                   torch.randn(slots, HKV, D, dtype=torch.bfloat16, device=dev)) for _ in range(LAYERS)]
        for bs in batches:
            indices = torch.randperm(slots, device=dev)[: bs * ctx].to(torch.int32)
            indptr = torch.arange(0, (bs + 1) * ctx, ctx, dtype=torch.int32)
            row = {"batch": bs, "context": ctx}
            for tc in (True, False):
                wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                    ws, "NHD", use_cuda_graph=True, use_tensor_cores=tc,
                    paged_kv_indptr_buffer=indptr.to(dev), paged_kv_indices_buffer=indices.clone(),
                    paged_kv_last_page_len_buffer=torch.ones(bs, dtype=torch.int32, device=dev))
                wrapper.plan(indptr, indices, torch.ones(bs, dtype=torch.int32), HQ, HKV, D, 1,
                             q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
                q = torch.randn(bs, HQ, D, dtype=torch.bfloat16, device=dev)
                try:
                    row["tensor_cores_us" if tc else "cuda_cores_us"] = round(
                        graph_time(lambda i, w=wrapper: w.run(q, caches[i]), LAYERS), 2)
                except Exception as e:  # (a kernel the bundle lacks: recorded)
                    row["tensor_cores_us" if tc else "cuda_cores_us"] = f"{type(e).__name__}: {e}"[:160]
            rows.append(row)
        del caches
        torch.cuda.empty_cache()
    return rows


def argmax_rows(batches: list[int], vocab: int = 128256) -> list[dict]:
    from services.worker.sampling.draw import greedy  # (two stages on CUDA: chunks of ~1k)

    rows = []
    for bs in batches:
        logits = [torch.randn(bs, vocab, device="cuda") for _ in range(4)]
        assert all(torch.equal(greedy(x), x.argmax(-1)) for x in logits)
        rows.append({"batch": bs, "argmax_us": round(graph_time(lambda i: logits[i].argmax(-1), 4), 2),
                     "two_stage_us": round(graph_time(lambda i: greedy(logits[i]), 4), 2)})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("decode_parts.json"))
    ap.add_argument("--batches", default="1,2,4,8,16,32,64")
    ap.add_argument("--contexts", default="256,1024,4096")
    args = ap.parse_args()
    batches = [int(v) for v in args.batches.split(",")]
    doc = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M"),
           "attention": attention_rows(batches, [int(v) for v in args.contexts.split(",")]),
           "argmax": argmax_rows([1, 8, 64])}
    args.out.write_text(json.dumps(doc, indent=1))
    print("| batch | context | tensor cores µs | CUDA cores µs |\n| ---: | ---: | ---: | ---: |")
    for r in doc["attention"]:
        print(f"| {r['batch']} | {r['context']} | {r['tensor_cores_us']} | {r['cuda_cores_us']} |")
    print("\n| batch | argmax µs | two-stage µs |\n| ---: | ---: | ---: |")
    for r in doc["argmax"]:
        print(f"| {r['batch']} | {r['argmax_us']} | {r['two_stage_us']} |")
    print(f"JSON: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
