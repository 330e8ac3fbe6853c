"""Which weight quantization a model is served with: the ``--quantization`` flag and the checkpoint's
``quantization_config`` (config.json) together. Supported: FP8 e4m3 weights, from an HF ``fp8``
checkpoint (per-tensor, per-channel or block-wise ``weight_scale`` / ``weight_scale_inv``), a
compressed-tensors float8 checkpoint, or quantized at load from a bf16/fp16/fp32 checkpoint. Every
other method (AWQ, GPTQ, bitsandbytes, int8/int4 compressed-tensors, …) is refused at start with a
message naming it: loading its packed tensors as plain weights would serve garbage."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

SUPPORTED = "fp8 (HF fp8 or compressed-tensors float8 checkpoints, or --quantization fp8 on a bf16/fp16/fp32 one)"


@dataclass(frozen=True)
class QuantConfig:
    """FP8 weights: ``source`` is "online" (quantized at load), "fp8" (an HF fp8 checkpoint) or
    "compressed-tensors"; ``block`` the (rows, cols) of the checkpoint's block-wise scales, if any.
    Activations are always scaled per token at run time (a checkpoint's static input scales unused)."""

    source: str
    block: tuple[int, int] | None = None

    @property
    def name(self) -> str:
        """How it is reported (WorkerReady, logs)."""
        return "fp8" if self.source == "online" else f"fp8 ({self.source} checkpoint)"


def resolve_quantization(hf: Mapping[str, Any], flag: str, where: str = "config.json") -> QuantConfig | None:
    """The checkpoint's ``quantization_config`` (or the older ``compression_config``) and the flag →
    the quantization to serve with (None: none). ValueError naming the method if unsupported."""
    qc = hf.get("quantization_config") or hf.get("compression_config")
    if flag not in ("", "fp8"):
        raise ValueError(f"--quantization {flag!r} is not supported; supported: {SUPPORTED}")
    if not qc:
        return QuantConfig("online") if flag == "fp8" else None
    if not isinstance(qc, Mapping):
        raise ValueError(f"{where}: quantization_config is not an object")
    method = str(qc.get("quant_method") or qc.get("quantization_method") or "").lower()
    if method == "fp8":
        return _hf_fp8(qc, where)
    if method == "compressed-tensors":
        return _compressed_tensors(qc, where)
    named = method or "(no quant_method)"
    raise ValueError(f"{where}: quantization method {named!r} is not supported (the checkpoint's weights are "
                     f"packed for it and cannot be served as they are); supported: {SUPPORTED}")


def _hf_fp8(qc: Mapping[str, Any], where: str) -> QuantConfig:
    fmt = str(qc.get("fmt", "e4m3")).lower()
    if fmt != "e4m3":
        raise ValueError(f"{where}: fp8 checkpoint with fmt {fmt!r} is not supported (only e4m3)")
    scheme = str(qc.get("activation_scheme", "dynamic")).lower()
    if scheme not in ("dynamic", "static"):
        raise ValueError(f"{where}: fp8 activation_scheme {scheme!r} is not supported (dynamic | static)")
    return QuantConfig("fp8", _block(qc.get("weight_block_size"), where))  # (static input scales: unused)


def _compressed_tensors(qc: Mapping[str, Any], where: str) -> QuantConfig:
    groups = qc.get("config_groups") or {}
    if not groups:
        raise ValueError(f"{where}: compressed-tensors quantization_config without config_groups")
    block = None
    for name, group in groups.items():
        fmt = str(group.get("format") or qc.get("format") or "float-quantized")
        w = group.get("weights") or {}
        kind, bits = str(w.get("type", "")).lower(), w.get("num_bits")
        if kind != "float" or bits != 8 or fmt not in ("float-quantized", "naive-quantized"):
            raise ValueError(f"{where}: compressed-tensors group {name!r} has {bits}-bit {kind or '?'} weights "
                             f"(format {fmt!r}); only float8 weights (format float-quantized) are supported")
        strategy = str(w.get("strategy", "tensor")).lower()
        if strategy == "block":
            block = _block(w.get("block_structure"), where)
        elif strategy not in ("tensor", "channel"):
            raise ValueError(f"{where}: compressed-tensors float8 weights with strategy {strategy!r} are not "
                             "supported (tensor | channel | block)")
        acts = group.get("input_activations") or {}
        if acts and (str(acts.get("type", "float")).lower() != "float" or acts.get("num_bits", 8) != 8):
            raise ValueError(f"{where}: compressed-tensors group {name!r} quantizes activations to "
                             f"{acts.get('num_bits')}-bit {acts.get('type')}; only float8 (or none) is supported")
    kv = qc.get("kv_cache_scheme")
    if kv and (str(kv.get("type", "float")).lower() != "float" or kv.get("num_bits", 8) != 8):
        raise ValueError(f"{where}: compressed-tensors kv_cache_scheme {kv.get('num_bits')}-bit {kv.get('type')} "
                         "is not supported (float8 only, with --kv-cache-dtype fp8_e4m3)")
    return QuantConfig("compressed-tensors", block)


def _block(value: Any, where: str) -> tuple[int, int] | None:
    if value is None:
        return None
    if not (isinstance(value, (list, tuple)) and len(value) == 2 and all(isinstance(v, int) and v > 0 for v in value)):
        raise ValueError(f"{where}: block size {value!r} is not a pair of positive integers")
    return int(value[0]), int(value[1])
