"""Rotary position embedding matching transformers' Llama (rotate-half), with rope scaling."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from services.worker.kernels.ops import RopeStep, current_ops


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters; ``rope_type`` "default", "linear" or "llama3"."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_positions: int = 8192

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> RopeConfig:
        """From transformers-5 ``rope_parameters`` or the older ``rope_theta`` + ``rope_scaling``."""
        params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in _ROPE_TYPES:
            raise NotImplementedError(f"rope type {rope_type!r} is not supported (supported: {sorted(_ROPE_TYPES)})")
        theta = float(params.get("rope_theta", hf.get("rope_theta", cls.theta)))
        if missing := [k for k in _ROPE_TYPES[rope_type][1] if k not in params]:
            raise ValueError(f"rope type {rope_type!r} needs {missing} in the rope parameters")
        return cls(
            theta=theta,
            rope_type=rope_type,
            factor=float(params.get("factor", cls.factor)),
            low_freq_factor=float(params.get("low_freq_factor", cls.low_freq_factor)),
            high_freq_factor=float(params.get("high_freq_factor", cls.high_freq_factor)),
            original_max_positions=int(params.get("original_max_position_embeddings", cls.original_max_positions)),
        )

    def inv_freq(self, head_dim: int) -> torch.Tensor:  # (D/2,) float32, as transformers computes it
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
        return _ROPE_TYPES[self.rope_type][0](1.0 / (self.theta**exponents), self)


def _llama3_scaling(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    low_freq_wavelen = rope.original_max_positions / rope.low_freq_factor
    high_freq_wavelen = rope.original_max_positions / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (rope.original_max_positions / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


# rope type -> (scaling of the default inverse frequencies, required rope parameters)
_ROPE_TYPES: dict[str, tuple[Callable[[torch.Tensor, RopeConfig], torch.Tensor], tuple[str, ...]]] = {
    "default": (lambda inv_freq, rope: inv_freq, ()),
    "linear": (lambda inv_freq, rope: inv_freq / rope.factor, ("factor",)),
    "llama3": (
        _llama3_scaling,
        ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    ),
}


class RotaryEmbedding(nn.Module):
    """cos/sin over positions [0, max_positions) as one float32 (P, D) table [cos | sin]; each step
    turns it into a ``RopeStep`` (the rotation of that step's positions, shared by all layers)."""

    def __init__(self, head_dim: int, max_positions: int, rope: RopeConfig) -> None:
        super().__init__()
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = positions[:, None] * rope.inv_freq(head_dim)[None, :]  # (P, D/2)
        self.register_buffer("cos_sin", torch.cat((freqs.cos(), freqs.sin()), dim=-1), persistent=False)
        self._step = current_ops().rope

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeStep:
        """(T,) positions -> a function rotating q (T, Hq, D) and k (T, Hkv, D) of those positions."""
        return self._step(self.cos_sin, positions, dtype)
