"""FP8 KV cache: the storage dtype, the per-layer scales (this rank's heads), the quantized write.

K and V are stored as e4m3 values ``q`` with a dequantization scale per layer and KV head: K ≈ q *
k_scale. The scales come from the checkpoint when it has them (``k_scale`` / ``v_scale`` per layer,
scalar or one per KV head, as FP8 checkpoints with a KV-cache scheme carry) and are 1.0 otherwise
(e4m3 keeps ~2 significant digits over 2^-6..448, where K and V values of usual models lie;
values beyond saturate).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from services.worker.numerics import FP8, FP8_MAX

Tensor = torch.Tensor
KV_DTYPE_NAMES = {"auto": None, "fp8_e4m3": FP8, "fp8": FP8}


def resolve_kv_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """``--kv-cache-dtype`` → the pool's storage dtype (auto: the model's)."""
    if name not in KV_DTYPE_NAMES:
        raise ValueError(f"unknown kv cache dtype {name!r}; expected one of {', '.join(KV_DTYPE_NAMES)}")
    return KV_DTYPE_NAMES[name] or model_dtype


@dataclass(frozen=True)
class KVScales:
    """Dequantization scales per layer, each (Hkv,) float32 over this rank's KV heads."""

    k: list[Tensor]
    v: list[Tensor]
    source: str  # "default" (all 1.0) | "checkpoint"

    @classmethod
    def ones(cls, num_layers: int, num_kv_heads: int) -> KVScales:
        one = [torch.ones(num_kv_heads) for _ in range(num_layers)]
        return cls(one, list(one), "default")


def layer_scales(found: Mapping[int, Mapping[str, Tensor]], num_layers: int, num_kv_heads: int,
                 tp_rank: int = 0, tp_size: int = 1) -> KVScales:
    """The checkpoint's KV scales (``found[layer]["k" | "v"]``: one value, or one per KV head of the
    whole model) → this rank's (heads split as ``QKVParallelLinear`` splits them; replicated when
    there are fewer heads than ranks). Layers without them get 1.0."""
    if num_kv_heads >= tp_size:
        local = num_kv_heads // tp_size
        heads = torch.arange(tp_rank * local, (tp_rank + 1) * local)
    else:
        local, heads = 1, torch.tensor([tp_rank * num_kv_heads // tp_size])
    out: dict[str, list[Tensor]] = {"k": [], "v": []}
    for layer in range(num_layers):
        for kind in ("k", "v"):
            s = found.get(layer, {}).get(kind)
            if s is None:
                out[kind].append(torch.ones(local))
                continue
            s = s.float().reshape(-1)
            if s.numel() == 1:
                out[kind].append(s.expand(local).clone())
            elif s.numel() == num_kv_heads:
                out[kind].append(s[heads].clone())
            else:
                raise ValueError(f"layer {layer}: {kind}_scale has {s.numel()} values; expected 1 or one per KV "
                                 f"head ({num_kv_heads})")
            if not bool((out[kind][-1] > 0).all()) or not bool(out[kind][-1].isfinite().all()):
                raise ValueError(f"layer {layer}: {kind}_scale must be positive and finite, got {s.tolist()}")
    return KVScales(out["k"], out["v"], "checkpoint" if found else "default")


def quantize_kv(x: Tensor, inv_scale: Tensor) -> Tensor:
    """(T, Hkv, D) → e4m3 of x / scale, per head (``inv_scale`` (Hkv,) fp32 = 1 / scale)."""
    return (x.float() * inv_scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8)


# (k_cache, v_cache, slots, k, v, k_inv, v_inv) -> None: the quantized write into the pool
StoreKernel = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor], None]
_store_kernel: StoreKernel | None = None  # the fused Triton kernel on CUDA, once checked


def set_store_kernel(fn: StoreKernel | None) -> None:
    global _store_kernel
    _store_kernel = fn


_plain_store_kernel: Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], None] | None = None  # (CUDA, once checked)


def set_plain_store_kernel(fn) -> None:
    global _plain_store_kernel
    _plain_store_kernel = fn


def store_plain(k_cache: Tensor, v_cache: Tensor, slots: Tensor, k: Tensor, v: Tensor) -> None:
    """Write the new tokens' K and V (T, Hkv, D) at ``slots`` (T,) of a bf16/fp16/fp32 pool: one
    Triton launch on CUDA (checked bit for bit at start-up), else two ``index_copy_``."""
    if _plain_store_kernel is not None and k.is_cuda and k.dtype == k_cache.dtype and k.stride(2) == 1 \
            and v.stride(2) == 1:
        _plain_store_kernel(k_cache, v_cache, slots, k, v)
        return
    k_cache.index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.index_copy_(0, slots, v.to(v_cache.dtype))


_rope_store_kernel = None  # kernels.rope_store.rope_store on CUDA, once checked


def set_rope_store_kernel(fn) -> None:
    global _rope_store_kernel
    _rope_store_kernel = fn


def rope_store_kernel():
    """The fused rope + K/V write where enabled (None: the rope, then the write)."""
    return _rope_store_kernel


def store_fp8(k_cache: Tensor, v_cache: Tensor, slots: Tensor, k: Tensor, v: Tensor, k_inv: Tensor,
              v_inv: Tensor) -> None:
    """Write the new tokens' K and V (T, Hkv, D), quantized, at ``slots`` (T,) of the caches."""
    if _store_kernel is not None and k.is_cuda:
        _store_kernel(k_cache, v_cache, slots, k, v, k_inv, v_inv)
        return
    for cache, x, inv in ((k_cache, k, k_inv), (v_cache, v, v_inv)):  # (as bytes: no FP8 index_copy_ on CPU)
        cache.view(torch.uint8).index_copy_(0, slots, quantize_kv(x, inv).view(torch.uint8))
