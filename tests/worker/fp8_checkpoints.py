"""Small FP8 checkpoints for the tests: a saved HF model directory re-saved with its linear layers
quantized in each layout the worker loads (HF ``fp8``: per tensor, per channel, block-wise;
compressed-tensors float8: per channel, per tensor, block-wise), optionally with KV-cache scales."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FP8, FP8_MAX = torch.float8_e4m3fn, 448.0
LINEAR = re.compile(r"\.(q|k|v|o|gate|up|down)_proj\.weight$")
LAYOUTS = ("fp8-tensor", "fp8-channel", "fp8-block", "ct-channel", "ct-tensor", "ct-block")
BLOCK = (32, 16)  # tiny models: blocks that split their 64..128-wide weights


def _q(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (w.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def quantize(w: torch.Tensor, how: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale) of a 2-D weight: ``tensor`` (scale shape (1,)), ``channel`` ((N, 1)), ``block`` (blocks)."""
    w = w.float()
    if how == "tensor":
        s = (w.abs().max() / FP8_MAX).reshape(1)
        return _q(w, s), s
    if how == "channel":
        s = w.abs().amax(1, keepdim=True) / FP8_MAX
        return _q(w, s), s
    b0, b1 = BLOCK
    n, k = w.shape
    grid = w.new_zeros(-(-n // b0), -(-k // b1))
    for i in range(grid.shape[0]):
        for j in range(grid.shape[1]):
            grid[i, j] = w[i * b0:(i + 1) * b0, j * b1:(j + 1) * b1].abs().max() / FP8_MAX
    full = grid.repeat_interleave(b0, 0)[:n].repeat_interleave(b1, 1)[:, :k]
    return _q(w, full), grid


def dequantized(path: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's linear weights as the FP8 values times their scales (fp32), by name."""
    t = load_file(path / "model.safetensors")
    cfg = json.loads((path / "config.json").read_text())["quantization_config"]
    block = cfg.get("weight_block_size") or (cfg.get("config_groups", {}).get("group_0", {}).get("weights") or {}).get(
        "block_structure")
    out = {}
    for name, w in t.items():
        if w.dtype != FP8:
            continue
        base = name.removesuffix("weight")
        s = t.get(base + "weight_scale", t.get(base + "weight_scale_inv")).float()
        if block and s.dim() == 2 and s.shape[1] > 1:
            n, k = w.shape
            s = s.repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
        out[name] = w.float() * (s if s.dim() == 2 else s.reshape(-1, 1))
    return out


def make_fp8_checkpoint(src: Path, out: Path, layout: str, kv_scales: str = "", keep: str = "") -> Path:
    """Re-save the model at ``src`` under ``out`` in ``layout`` (``LAYOUTS``). ``kv_scales``:
    "layer" (one k/v scale per layer) or "head" (one per KV head); ``keep``: a regex of linear
    weights left unquantized (the checkpoint's ignore list)."""
    family, how = layout.split("-")
    tensors = load_file(src / "model.safetensors")
    cfg = json.loads((src / "config.json").read_text())
    out.mkdir(parents=True, exist_ok=True)
    saved: dict[str, torch.Tensor] = {}
    for name, w in tensors.items():
        if not LINEAR.search(name) or (keep and re.search(keep, name)):
            saved[name] = w.contiguous()
            continue
        q, s = quantize(w, how)
        base = name.removesuffix("weight")
        scale_name = "weight_scale_inv" if (family, how) == ("fp8", "block") else "weight_scale"
        saved[name], saved[base + scale_name] = q, s.contiguous()
        if how == "tensor":  # static activation scales (as calibrated checkpoints carry; served per token)
            saved[base + "input_scale"] = torch.tensor([0.05])
    kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    for layer in range(cfg["num_hidden_layers"]) if kv_scales else ():
        for i, kind in enumerate("kv"):
            n = kv_heads if kv_scales == "head" else 1
            value = torch.linspace(0.02, 0.05, n) * (1 + i) * (1 + layer)
            name = f"model.layers.{layer}.self_attn.{kind}_scale" if family == "fp8" else \
                f"model.layers.{layer}.self_attn.{kind}_proj.output_scale"
            saved[name] = value if kv_scales == "head" else value.reshape(())
    save_file(saved, out / "model.safetensors", metadata={"format": "pt"})
    if family == "fp8":
        qc: dict = {"quant_method": "fp8", "fmt": "e4m3",
                    "activation_scheme": "static" if how == "tensor" else "dynamic"}
        if how == "block":
            qc["weight_block_size"] = list(BLOCK)
    else:
        weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": how,
                   "block_structure": list(BLOCK) if how == "block" else None}
        acts = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor" if how == "tensor" else "token",
                "dynamic": how != "tensor"}
        qc = {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
              "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts}},
              "ignore": ["lm_head"],
              "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor"} if kv_scales else None}
    cfg["quantization_config"] = qc
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    for f in src.iterdir():
        if f.is_file() and f.name not in ("model.safetensors", "config.json", "model.safetensors.index.json"):
            shutil.copy(f, out / f.name)
    return out


def with_quantization_config(src: Path, out: Path, qc: dict) -> Path:
    """A copy of the model at ``src`` whose config.json claims ``qc`` (for the refusal tests)."""
    shutil.copytree(src, out, dirs_exist_ok=True)
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = qc
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    return out
