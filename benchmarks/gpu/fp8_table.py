"""The table ``fp8_check.py`` prints last (kept apart to keep that script short)."""

from __future__ import annotations


def table(R: dict, shapes) -> str:
    """The last lines ``fp8_check`` prints: its goals' figures from the results ``R``."""
    run, att = R.get("runners", {}), R.get("attention", {})
    rows = [("KV pool tokens, FP8 / bf16 (goal ≥ 1.95)", run.get("pool_ratio_fp8_kv")),
            ("FP8 KV: top-1 agreement with bf16, margin ≥ 0.1 (goal ≥ 0.97)",
             run.get("fp8_kv", {}).get("vs_bf16", {}).get("top1_agreement")),
            ("FP8 weights: top-1 agreement with bf16 (goal ≥ 0.95)",
             run.get("fp8_weights", {}).get("vs_bf16", {}).get("top1_agreement")),
            ("  + FP8 lm_head too (what if)", run.get("fp8_weights", {}).get("fp8_lm_head_too_vs_bf16", {}).get(
                "top1_agreement")),
            ("FP8 weights + --fp8-vocab: top-1 agreement with bf16",
             run.get("fp8_weights_vocab", {}).get("vs_bf16", {}).get("top1_agreement")),
            ("weight bytes with --fp8-vocab, FP8 / bf16 (goal ≤ 0.52)", run.get("weight_ratio_fp8_vocab")),
            ("batch-1 decode replay ms, FP8 weights + --fp8-vocab",
             run.get("fp8_weights_vocab", {}).get("w1", {}).get("replay_ms")),
            ("weight bytes, FP8 / bf16 (goal ≤ 0.52)", run.get("weight_ratio_fp8")),
            ("  with lm_head + embeddings FP8 too (what if)", run.get("weight_ratio_fp8_with_head_and_embed")),
            ("batch-1 decode replay ms, bf16", run.get("bf16", {}).get("w1", {}).get("replay_ms")),
            ("batch-1 decode replay ms, FP8 weights (goal ≤ 2.6)",
             run.get("fp8_weights", {}).get("w1", {}).get("replay_ms")),
            ("batch-1 decode replay ms, FP8 KV", run.get("fp8_kv", {}).get("w1", {}).get("replay_ms")),
            ("FP8 KV: graph-replayed vs eager decode logits, rel. err", run.get("fp8_kv", {}).get(
                "graphs_vs_eager_rel_err")),
            ("decode 64x1k µs/layer bf16 KV (tensor cores)", att.get("decode_64x1k_bf16_tensor_cores_us")),
            ("decode 64x1k µs/layer FP8 KV, tensor cores", att.get("decode_64x1k_fp8_tensor_cores_us")),
            ("decode 64x1k µs/layer FP8 KV, CUDA cores", att.get("decode_64x1k_fp8_cuda_cores_us")),
            ("faster FP8 decode variant", att.get("fp8_faster_decode")),
            ("FP8 checkpoint: top-1 vs online FP8", R.get("checkpoint", {}).get("vs_online_fp8", {}).get(
                "top1_agreement"))]
    for name in shapes:
        for m in (1, 8, 64, 256):
            rows.append((f"gemm {name} M={m}: bf16 / fp8 µs", "{} / {}".format(
                *(_fmt(R.get("gemm", {}).get(f"{name}_m{m}_{v}_us")) for v in ("bf16", "fp8_rowwise_with_act_quant")))))
    return "\n".join(f"{label:62} {_fmt(v)}" for label, v in rows)


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)
