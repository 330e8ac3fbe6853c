"""GGUF architectures Banyan serves: the HF config built from the file's metadata, and each GGUF
tensor's HF name (with llama.cpp's Q/K row permutation undone where its converter applied one)."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from shared.gguf.reader import GGUFError, GGUFFile


@dataclass(frozen=True)
class Arch:
    hf_architecture: str
    model_type: str
    permuted_qk: bool  # llama.cpp's converter interleaves q/k rows for its rope (llama family only)
    extra: Callable[[GGUFFile], dict[str, Any]] = lambda f: {}


ARCHES: dict[str, Arch] = {
    "llama": Arch("LlamaForCausalLM", "llama", True,
                  lambda f: {"attention_bias": "blk.0.attn_q.bias" in f.tensors, "mlp_bias": False}),
    "qwen2": Arch("Qwen2ForCausalLM", "qwen2", False, lambda f: {"use_sliding_window": False}),
    "qwen3": Arch("Qwen3ForCausalLM", "qwen3", False, lambda f: {"attention_bias": False}),
}

_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
_LAYER = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
          "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
          "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def arch_of(f: GGUFFile) -> Arch:
    name = f.architecture
    if name not in ARCHES:
        raise GGUFError(f"{f.path}: architecture {name!r} is not supported (supported: {', '.join(sorted(ARCHES))})")
    return ARCHES[name]


def hf_config(f: GGUFFile, dtype: str) -> dict[str, Any]:
    """config.json of the file's model, from the architecture's metadata keys."""
    arch = arch_of(f)
    if "rope_freqs.weight" in f.tensors:
        raise GGUFError(f"{f.path}: per-frequency RoPE factors (rope_freqs.weight, Llama 3.1 style) are not supported")
    scaling = f.arch("rope.scaling.type", "none")
    if scaling not in ("none", ""):
        raise GGUFError(f"{f.path}: RoPE scaling {scaling!r} is not supported (only none)")
    hidden, heads = int(f.arch("embedding_length")), int(f.arch("attention.head_count"))
    tokens = f.get("tokenizer.ggml.tokens") or []
    vocab = int(f.arch("vocab_size", 0)) or len(tokens) or int(f.tensors["token_embd.weight"].shape[1])
    config: dict[str, Any] = {
        "architectures": [arch.hf_architecture], "model_type": arch.model_type,
        "hidden_size": hidden, "intermediate_size": int(f.arch("feed_forward_length")),
        "num_hidden_layers": int(f.arch("block_count")), "num_attention_heads": heads,
        "num_key_value_heads": int(f.arch("attention.head_count_kv", heads)),
        "head_dim": int(f.arch("attention.key_length", hidden // heads)),
        "max_position_embeddings": int(f.arch("context_length")),
        "rms_norm_eps": float(f.arch("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(f.arch("rope.freq_base", 10000.0)), "hidden_act": "silu", "vocab_size": vocab,
        "tie_word_embeddings": "output.weight" not in f.tensors, "torch_dtype": dtype,
    }
    for key in ("bos", "eos", "padding"):
        if (token_id := f.get(f"tokenizer.ggml.{key}_token_id")) is not None:
            config["pad_token_id" if key == "padding" else f"{key}_token_id"] = int(token_id)
    return {**config, **arch.extra(f)}


def hf_name(f: GGUFFile, name: str) -> str:
    """The HF parameter name of GGUF tensor ``name``; ``GGUFError`` for one with no place in the model."""
    if name in _GLOBAL:
        return _GLOBAL[name]
    m = _BLOCK.fullmatch(name)
    if m and m.group(2) in _LAYER:
        return f"model.layers.{m.group(1)}.{_LAYER[m.group(2)]}.{m.group(3)}"
    raise GGUFError(f"{f.path}: tensor {name!r} has no place in a {f.architecture} model")


def unpermute(f: GGUFFile, name: str, values: np.ndarray) -> np.ndarray:
    """``values`` in HF's row order. llama.cpp's converter reorders each head's q and k rows from HF's
    two halves (rotate_half) to interleaved pairs; the inverse takes them back."""
    if not arch_of(f).permuted_qk:
        return values
    m = _BLOCK.fullmatch(name)
    if not m or m.group(2) not in ("attn_q", "attn_k"):
        return values
    heads = int(f.arch("attention.head_count"))
    if m.group(2) == "attn_k":
        heads = int(f.arch("attention.head_count_kv", heads))
    rows = values.shape[0]
    # (heads, D/2, 2, …) → (heads, 2, D/2, …): pair element i of a head back to rows i and i + D/2
    return values.reshape(heads, rows // heads // 2, 2, *values.shape[1:]).swapaxes(1, 2).reshape(values.shape)
