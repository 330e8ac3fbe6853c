"""Model registry: HF ``architectures`` name -> implementing class, imported on first use."""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch
    from torch import nn

    from services.worker.attention.base import AttentionBackend
    from services.worker.models.layers import ShardId
    from services.worker.tp import TPGroup
    from services.worker.models.config import DecoderConfig

# architecture -> (module under services.worker.models, class name)
_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
}


class CausalLM(Protocol):
    """The interface of every registered model class (an ``nn.Module``)."""

    @classmethod
    def parse_config(cls, hf: Mapping[str, Any]) -> DecoderConfig: ...

    def __init__(self, config: DecoderConfig, tp: TPGroup) -> None: ...

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        """input_ids, positions (T,) int64 -> hidden (T, H)."""

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """(N, H) -> (N, V) float32, full vocabulary (written into ``out`` when given)."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[tuple[str, ShardId]]: ...

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]: ...


def supported_architectures() -> list[str]:
    return sorted(_ARCHITECTURES)


def model_class(architecture: str) -> type[CausalLM]:
    """The class implementing an HF architecture; ValueError if none does."""
    if architecture not in _ARCHITECTURES:
        supported = ", ".join(supported_architectures())
        raise ValueError(f"unsupported architecture {architecture!r}; supported: {supported}")
    module, name = _ARCHITECTURES[architecture]
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
