"""Build a random-weight Llama-3.1-8B-shaped model on the GPU and save it as an HF directory.

    python -m benchmarks.gpu.make_model --out /tmp/llama8b --tokenizer .assets/llama3

Shape: hidden 4096, 32 layers, 32 q / 8 KV heads of 128, intermediate 14336, vocab 128256, rope
theta 500000 with llama3 scaling (factor 8, low 1, high 4, original 8192); bf16 weights drawn by
transformers' own initializer (normal, std 0.02; norms 1) from a fixed seed.
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=131072,
                rms_norm_eps=1e-5, bos_token_id=128000, eos_token_id=[128001, 128008, 128009],
                initializer_range=0.02, tie_word_embeddings=False, rope_theta=500000.0,
                rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                  original_max_position_embeddings=8192))
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def build(out: Path, tokenizer: Path | None = None, seed: int = 0, device: str = "cuda", **overrides) -> Path:
    """Save the model (``overrides`` change the shape, e.g. fewer layers for tests) under ``out``."""
    import torch
    import transformers

    if (out / "config.json").exists():
        return out
    cfg = transformers.LlamaConfig(**{**LLAMA_8B, **overrides})
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if tokenizer is not None and (tokenizer / name).exists():
            shutil.copyfile(tokenizer / name, tmp / name)
    tmp.rename(out)
    del model
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("/tmp/llama8b"))
    ap.add_argument("--tokenizer", type=Path, default=Path(".assets/llama3"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, default=32)
    args = ap.parse_args()
    t0 = time.perf_counter()
    build(args.out, args.tokenizer, args.seed, num_hidden_layers=args.layers)
    print(f"model at {args.out} in {time.perf_counter() - t0:.1f} s", flush=True)


if __name__ == "__main__":
    main()
