"""Llama-style decoder (also Mistral, and the base of Qwen2/Qwen3 through ``parse_config``)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from services.worker.attention.base import AttentionBackend
from services.worker.models.layers import (
    GateUpParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RowParallelLinear,
    ShardId,
    SiluAndMul,
    TPGroup,
    VocabParallelEmbedding,
)
from services.worker.models.config import DecoderConfig
from services.worker.kernels.ops import RopeStep
from services.worker.models.rotary import RopeConfig, RotaryEmbedding
from services.worker.quant.fp8 import QuantizedActivation

WeightKey = tuple[str, ShardId]  # (parameter name, shard id)

# (fused parameter, checkpoint projection, shard id)
_FUSED: tuple[tuple[str, str, ShardId], ...] = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: DecoderConfig, layer: int, tp: TPGroup) -> None:
        super().__init__()
        self.layer = layer
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.qkv_bias, tp
        )
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, cfg.o_bias, tp)
        self.q_norm: nn.Module = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else nn.Identity()
        self.k_norm: nn.Module = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else nn.Identity()
        heads, kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads  # this rank's
        self.q_shape, self.kv_shape = (heads, cfg.head_dim), (kv_heads, cfg.head_dim)
        self.qkv_split = [heads * cfg.head_dim, kv_heads * cfg.head_dim, kv_heads * cfg.head_dim]

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The q/k/v projection's output (T, (Hq + 2 Hkv) D) → q (T, Hq, D), k and v (T, Hkv, D), not rotated yet."""
        q, k, v = qkv.split(self.qkv_split, dim=-1)
        q, k = self.q_norm(q.unflatten(-1, self.q_shape)), self.k_norm(k.unflatten(-1, self.kv_shape))
        return q, k, v.unflatten(-1, self.kv_shape)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: DecoderConfig, tp: TPGroup) -> None:
        super().__init__()
        inter = cfg.intermediate_size
        self.gate_up_proj = GateUpParallelLinear(cfg.hidden_size, inter, cfg.mlp_bias, tp)
        self.act = SiluAndMul()
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, cfg.mlp_bias, tp)
        self.down_proj.silu_mul_input = True

    def forward(self, x: torch.Tensor | QuantizedActivation) -> torch.Tensor:  # (T, H) -> (T, H)
        """x: the post-attention norm's output, maybe quantized (FP8 linears: ``RMSNorm.for_linear``). At decode
        sizes the activation is made by the gate/up kernel as it stores, or by the down projection's as it loads,
        where either measured faster; else a kernel of its own (quantizing as it writes, for an FP8 down)."""
        act = self.gate_up_proj.forward_silu_mul(x)
        if act is not None:
            return self.down_proj(act)
        return self.down_proj.forward_silu_mul(self.gate_up_proj(x), self.act)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig, layer: int, tp: TPGroup) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, layer, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg, tp)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, rope: RopeStep, attn: AttentionBackend
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's output, residual: the stream before it (None at layer 0), both
        (T, H) -> this layer's (output, residual); the stream is residual + output."""
        q, k, v, residual = self.before_attention(x, residual)
        out = attn.forward(q, k, v, self.self_attn.layer, rope)  # (T, Hq, D); rotates q, k
        return self.after_attention(out.flatten(1), residual)

    # The layer's two halves around its attention (piecewise CUDA graphs, ``piecewise.py``, capture
    # the work between two attentions, which run eagerly).
    def before_attention(self, x: torch.Tensor, residual: torch.Tensor | None
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """→ (q, k, v, residual): the input norm and the q/k/v projection (one kernel at decode sizes where
        it measured so: ``RMSNorm.then``)."""
        qkv, residual = self.input_layernorm.then(self.self_attn.qkv_proj, x, residual)
        return (*self.self_attn.split(qkv), residual)

    def after_attention(self, out: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The attention's output (T, Hq * D) → this layer's (output, residual)."""
        x, residual = self.post_attention_layernorm.for_linear(self.mlp.gate_up_proj, self.self_attn.o_proj(out),
                                                               residual, "act_out")
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: DecoderConfig, tp: TPGroup) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.max_positions, cfg.rope)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i, tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend,
                between_layers: Callable[[], None] | None = None) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None  # (T, H)
        rope = self.rotary_emb(positions, x.dtype)
        for layer in self.layers:
            x, residual = layer(x, residual, rope, attn)
            if between_layers is not None:
                between_layers()
        return self.norm(x, residual)[0]


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: DecoderConfig, tp: TPGroup) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, tp)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
            if self.lm_head.fp8:  # (FP8 rows: their scales are shared too)
                self.lm_head.weight_scale = self.model.embed_tokens.weight_scale

    @classmethod
    def parse_config(cls, hf: Mapping[str, Any]) -> DecoderConfig:
        """Architecture variants override this (and only this) to switch options on."""
        if hf.get("hidden_act", "silu") != "silu":
            raise NotImplementedError(f"hidden_act {hf['hidden_act']!r} is not supported (only silu)")
        max_positions = hf["max_position_embeddings"]
        window = hf.get("sliding_window") if hf.get("use_sliding_window", True) else None
        if window is not None and window < max_positions:
            raise NotImplementedError(f"sliding-window attention ({window} < {max_positions}) is not supported")
        num_heads = hf["num_attention_heads"]
        attention_bias = hf.get("attention_bias", False)
        return DecoderConfig(
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            vocab_size=hf["vocab_size"],
            max_positions=max_positions,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope=RopeConfig.from_hf(hf),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            qkv_bias=attention_bias,
            o_bias=attention_bias,
            mlp_bias=hf.get("mlp_bias", False),
        )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend,
                between_layers: Callable[[], None] | None = None) -> torch.Tensor:
        """input_ids, positions (T,) int64 -> final-normed hidden states (T, H); ``between_layers``
        is called after each layer's work is queued (eager steps: the host may do other work)."""
        return self.model(input_ids, positions, attn, between_layers)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """(N, H) -> (N, V) float32 over the full vocabulary (into ``out`` when given)."""
        return self.lm_head(hidden, out)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[WeightKey]:
        """Copy HF-named checkpoint tensors into the parameters; returns what was loaded."""
        params = dict(self.named_parameters())
        loaded: set[WeightKey] = set()
        for hf_name, tensor in weights:
            if hf_name.endswith("rotary_emb.inv_freq") or (
                hf_name == "lm_head.weight" and self.config.tie_word_embeddings
            ):
                continue
            name, shard_id = _param_name(hf_name)
            if name not in params:
                raise ValueError(f"checkpoint tensor {hf_name!r} matches no parameter of {type(self).__name__}")
            params[name].weight_loader(params[name], tensor, shard_id)
            loaded.add((name, shard_id))
        return loaded


def _param_name(hf_name: str) -> WeightKey:
    for fused, part, shard_id in _FUSED:
        if f".{part}." in hf_name:
            return hf_name.replace(f".{part}.", f".{fused}."), shard_id
    return hf_name, None
