"""Reading a safetensors checkpoint for the model's ``load_weights``, FP8 checkpoints included.

Every FP8 weight is paired here with its scale (``X.weight_scale``, or ``X.weight_scale_inv`` as
block-wise checkpoints name it), so the layers never see one without the other:

- a linear layer's weight with a per-tensor or per-row scale → ``QuantizedWeight`` (copied as it is);
- block-wise scales (``weight_block_size`` / ``block_structure``) → dequantized to fp32 here and
  re-quantized per row by the layer (one more rounding; the GEMM takes row-wise scales);
- any other FP8 tensor (an embedding, lm_head) → dequantized: those stay in the model dtype.

KV-cache scales (``self_attn.k_scale`` / ``v_scale``, also under ``k_proj.`` / ``attn.``, the older
``kv_scale`` for both, compressed-tensors' ``k_proj.output_scale``) are collected into ``kv_scales``;
static activation scales (``input_scale``) and attention-probability scales are dropped: activations
are scaled per token at run time.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from services.worker.quant.config import QuantConfig
from services.worker.quant.fp8 import FP8, QuantizedWeight, dequantize_blocks

Tensor = torch.Tensor
LINEAR = re.compile(r"\.(?:q|k|v|o|gate|up|down)_proj\.weight$")  # the layers built with FP8 weights
_KV_SCALE = re.compile(r"\.layers\.(\d+)\.self_attn\.(?:(?:k_proj|v_proj|attn)\.)?(k|v|kv)_scale$")
_KV_OUTPUT_SCALE = re.compile(r"\.layers\.(\d+)\.self_attn\.(k|v)_proj\.output_scale$")
_WEIGHT_SCALES = ("weight_scale", "weight_scale_inv")
_DROPPED = (".input_scale", ".q_scale", ".prob_scale", ".output_scale", ".weight_zero_point", ".input_zero_point")


class Checkpoint:
    """The tensors of an HF model directory by name (with an index json, only the files it maps)."""

    def __init__(self, model_dir: str | Path) -> None:
        self.dir = Path(model_dir)
        index = self.dir / "model.safetensors.index.json"
        if index.exists():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        else:
            files = sorted(p.name for p in self.dir.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors files in {self.dir}")
        self._files = {f: safe_open(self.dir / f, framework="pt") for f in files}
        self.where = {name: f for f, h in self._files.items() for name in h.keys()}  # noqa: SIM118

    def names(self) -> list[str]:
        return list(self.where)

    def get(self, name: str) -> Tensor:
        return self._files[self.where[name]].get_tensor(name)


def read_weights(ckpt: Checkpoint, quant: QuantConfig | None, kv_scales: dict[int, dict[str, Tensor]]
                 ) -> Iterator[tuple[str, Tensor | QuantizedWeight]]:
    """(name, tensor or QuantizedWeight) for ``load_weights``; KV-cache scales go into ``kv_scales``
    (layer → "k" / "v" → tensor). ``quant`` None: FP8 tensors are all dequantized."""
    names = set(ckpt.where)
    for name in ckpt.names():
        if m := _KV_SCALE.search(name) or _KV_OUTPUT_SCALE.search(name):
            layer, kind = int(m.group(1)), m.group(2)
            for k in ("k", "v") if kind == "kv" else (kind,):
                kv_scales.setdefault(layer, {})[k] = ckpt.get(name)
            continue
        base, _, leaf = name.rpartition(".")
        if leaf in _WEIGHT_SCALES:
            if f"{base}.weight" not in names:
                raise ValueError(f"checkpoint tensor {name!r} is a weight scale without its weight {base}.weight")
            continue  # read with its weight
        if name.endswith(_DROPPED):
            continue
        tensor = ckpt.get(name)
        if tensor.dtype == torch.float8_e5m2:
            raise ValueError(f"checkpoint tensor {name!r} is float8_e5m2; only e4m3 FP8 checkpoints are supported")
        yield name, (_fp8(ckpt, name, tensor, quant, names) if tensor.dtype == FP8 else tensor)


def _fp8(ckpt: Checkpoint, name: str, data: Tensor, quant: QuantConfig | None,
         names: set[str]) -> Tensor | QuantizedWeight:
    base = name.removesuffix("weight")
    scale_name = next((base + s for s in _WEIGHT_SCALES if base + s in names), None)
    if not name.endswith(".weight") or scale_name is None:
        raise ValueError(f"checkpoint tensor {name!r} is FP8 but has no {base}weight_scale beside it")
    scale = ckpt.get(scale_name)
    if data.dim() != 2:
        raise ValueError(f"checkpoint tensor {name!r} is FP8 with {data.dim()} dimensions; expected a 2-D weight")
    if scale.dim() == 2 and scale.shape[1] > 1:  # block-wise: (ceil(N / b0), ceil(K / b1))
        block = quant.block if quant is not None else None
        if block is None:
            raise ValueError(f"{scale_name} has block-wise shape {tuple(scale.shape)} but the quantization_config "
                             "gives no block size (weight_block_size / block_structure)")
        return dequantize_blocks(data, scale, block)
    weight = QuantizedWeight(data, scale)
    if quant is not None and LINEAR.search(name):
        return weight
    return data.float() * weight.row_scale()[:, None]  # kept in the model dtype
