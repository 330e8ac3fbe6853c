"""What a model file is built from: the decoder's hyperparameters, parsed from an HF ``config.json``."""

from __future__ import annotations

from dataclasses import dataclass

from services.worker.models.rotary import RopeConfig


@dataclass(frozen=True)
class DecoderConfig:
    """Hyperparameters of a Llama-style decoder, parsed from an HF ``config.json`` dict."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_positions: int
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # RMSNorm over each q/k head before RoPE
