"""Reads an HF model directory: its ``ModelSpec`` and its safetensors weights (FP8 checkpoints and
``--quantization fp8``: services/worker/quant)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from services.worker.models import CausalLM, model_class, supported_architectures
from services.worker.models.layers import kv_heads_per_rank
from services.worker.tp import TPGroup
from services.worker.models.config import DecoderConfig
from services.worker.kernels.ops import TORCH_OPS, Ops, use_ops
from services.worker.quant import fp8_linears
from services.worker.quant.checkpoint import Checkpoint, read_weights
from services.worker.quant.config import QuantConfig, resolve_quantization


@dataclass(frozen=True)
class ModelSpec:
    """What the rest of the worker needs to know about a model, before and after loading it."""

    architecture: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden: int
    vocab_size: int
    context_length: int  # max_position_embeddings
    eos_token_ids: tuple[int, ...]  # config.json, then generation_config.json

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelSpec:
        return _resolve(Path(model_dir))[2]

    def kv_heads_per_rank(self, tp_size: int) -> int:
        """KV heads each rank's pool holds."""
        return kv_heads_per_rank(self.num_kv_heads, tp_size)


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype,
    device: torch.device | str,
    tp: TPGroup | None = None,
    ops: Ops = TORCH_OPS,
    quantization: str = "",
    fp8_vocab: bool = False,
) -> tuple[CausalLM, ModelSpec]:
    """Build the model for this rank (uninitialized) on ``ops``'s kernels and fill every parameter
    from the checkpoint. ``quantization`` is ``--quantization``; with it or an FP8 checkpoint the
    linear layers hold FP8 weights (with ``fp8_vocab`` the embeddings and lm_head too). The model gets ``quant`` (the ``QuantConfig``, or None) and
    ``kv_scales`` (the checkpoint's KV-cache scales: layer → "k" / "v" → tensor; maybe empty)."""
    model_dir = Path(model_dir)
    cls, config, spec = _resolve(model_dir)
    quant = quant_config(model_dir, quantization)
    if fp8_vocab and quant is None:
        raise ValueError("--fp8-vocab needs FP8 weights: --quantization fp8, or an FP8 checkpoint")
    with torch.device(device), _default_dtype(dtype), use_ops(ops), fp8_linears(quant is not None, fp8_vocab):
        model = cls(config, tp or TPGroup())
    kv_scales: dict[int, dict[str, torch.Tensor]] = {}
    loaded = model.load_weights(read_weights(Checkpoint(model_dir), quant, kv_scales))
    expected = {(name, s) for name, p in model.named_parameters() for s in getattr(p, "shard_ids", (None,))
                if not getattr(p, "derived", False)}  # (FP8 weight scales: loaded with their weights)
    if missing := expected - loaded:
        names = sorted(name if s is None else f"{name} (shard {s})" for name, s in missing)
        raise ValueError(f"{model_dir}: the checkpoint lacks {len(names)} weights: {', '.join(names)}")
    model.quant, model.kv_scales = quant, kv_scales
    return model, spec


def quant_config(model_dir: str | Path, quantization: str = "") -> QuantConfig | None:
    """The weight quantization the model is served with (ValueError: an unsupported one)."""
    config_path = Path(model_dir) / "config.json"
    return resolve_quantization(_read_json(config_path), quantization, str(config_path))


def _resolve(model_dir: Path) -> tuple[type[CausalLM], DecoderConfig, ModelSpec]:
    config_path = model_dir / "config.json"
    hf = _read_json(config_path)
    architectures = hf.get("architectures") or []
    if not architectures:
        raise ValueError(f"{config_path} names no architecture; supported: {', '.join(supported_architectures())}")
    cls = model_class(architectures[0])
    try:
        config = cls.parse_config(hf)
    except KeyError as e:
        raise ValueError(f"{config_path} lacks {e}") from None
    spec = ModelSpec(
        architecture=architectures[0],
        num_layers=config.num_layers,
        num_heads=config.num_heads,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        hidden=config.hidden_size,
        vocab_size=config.vocab_size,
        context_length=config.max_positions,
        eos_token_ids=_eos_token_ids(hf, model_dir / "generation_config.json"),
    )
    return cls, config, spec


def _eos_token_ids(hf: dict[str, Any], generation_config: Path) -> tuple[int, ...]:
    ids: list[int] = []
    for source in (hf, _read_json(generation_config) if generation_config.exists() else {}):
        eos = source.get("eos_token_id")
        ids += [eos] if isinstance(eos, int) else eos or []
    return tuple(dict.fromkeys(ids))


def _read_json(path: Path) -> dict[str, Any]:
    with path.open() as f:
        return json.load(f)


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
