"""The paged KV cache (page size 1): per layer, K and V slot tensors, in the model dtype or FP8."""

from __future__ import annotations

import math
import mmap

import torch

from services.worker.quant.fp8 import FP8
from services.worker.quant.kv import KVScales, rope_store_kernel, store_fp8, store_plain


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed tensor; on the CPU in anonymous memory (zero pages from the OS, faulted in as slots are first
    written): a 1 GiB pool's zeros are not written at every CPU start (0.2 s quiet, seconds with the cores busy)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    return torch.frombuffer(mmap.mmap(-1, max(nbytes, 1)), dtype=torch.uint8)[:nbytes].view(dtype).view(shape)


class KVPool:
    """``k[l]``, ``v[l]``: (num_slots, num_kv_heads, head_dim) per layer ``l``, of ``dtype`` (the
    model's; queries and outputs keep it) or of ``kv_dtype`` when given: FP8 e4m3, stored as
    x / scale with a dequantization scale per layer and KV head (``scales``; 1.0 by default).

    ``num_slots`` includes slot 0, the padding slot that is never allocated; the tensors start
    zeroed so that reading padding yields finite values. All of them are views of one buffer
    (2, layers, num_slots, Hkv, D), so a token's KV can be gathered in one go (``tokens``: the
    hierarchical cache's copies between tiers).
    """

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        kv_dtype: torch.dtype | None = None,
        scales: KVScales | None = None,
    ) -> None:
        if num_slots < 2:
            raise ValueError(f"a KV pool needs at least 2 slots (slot 0 is padding), got {num_slots}")
        if kv_dtype not in (None, dtype, FP8):
            raise ValueError(f"a KV pool stores the model dtype or {FP8}, not {kv_dtype}")
        self.compute_dtype = dtype
        shape = (num_slots, num_kv_heads, head_dim)
        store = kv_dtype or dtype
        self.buf = zeroed((2, num_layers, *shape), store, torch.device(device))
        self.k = list(self.buf[0].unbind(0))
        self.v = list(self.buf[1].unbind(0))
        self.quantized = store == FP8
        self.scales = None
        if self.quantized:
            self.scales = scales or KVScales.ones(num_layers, num_kv_heads)
            if len(self.scales.k) != num_layers or any(s.shape != (num_kv_heads,) for s in self.scales.k + self.scales.v):
                raise ValueError(f"KV scales for {len(self.scales.k)} layers; expected {num_layers} of {num_kv_heads}")
            as_dev = lambda xs: [x.float().to(device) for x in xs]  # noqa: E731
            self.k_scale, self.v_scale = as_dev(self.scales.k), as_dev(self.scales.v)
            self._k_inv = [1.0 / s for s in self.k_scale]
            self._v_inv = [1.0 / s for s in self.v_scale]

    @property
    def num_slots(self) -> int:
        return self.k[0].shape[0]

    @property
    def dtype(self) -> torch.dtype:
        """What the pool stores (FP8 when quantized)."""
        return self.k[0].dtype

    @property
    def device(self) -> torch.device:
        return self.k[0].device

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token over all layers and this rank's heads."""
        return 2 * len(self.k) * self.k[0][0].numel() * self.dtype.itemsize

    def tokens(self) -> torch.Tensor:
        """The pool by token, as bytes: (num_slots, 2, layers, Hkv, D · itemsize) uint8, a view."""
        return self.buf.view(torch.uint8).permute(2, 0, 1, 3, 4)

    def store(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write the new tokens' K and V (T, Hkv, D) at ``slots`` (T,) of ``layer`` (quantized when FP8)."""
        if self.quantized:
            store_fp8(self.k[layer], self.v[layer], slots, k, v, self._k_inv[layer], self._v_inv[layer])
            return
        store_plain(self.k[layer], self.v[layer], slots, k, v)

    def store_rope(self, layer: int, slots: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   rope) -> tuple[torch.Tensor, torch.Tensor]:
        """``rope`` (a ``RopeStep``) applied to q (T, Hq, D) and k, then ``store`` of the rotated k
        and v → the rotated (q, k). One launch where the fused kernel is enabled (CUDA, checked at
        start-up: ``startup.enable_rope_store``), rotating q and k in place."""
        fused = rope_store_kernel()
        if fused is not None and (args := self.rope_args(layer, q, k, v, rope)) is not None:
            fused(q, k, v, self.k[layer], self.v[layer], slots, *args)
            return q, k
        q, k = rope(q, k)
        self.store(layer, slots, k, v)
        return q, k

    def rope_args(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope) -> tuple | None:
        """(cos_sin, positions, k_inv, v_inv) for a Triton kernel that rotates q and k (rotate-half, the
        whole head) and writes k and v to ``layer`` — ``rope_store``, or the decode attention itself — or
        None where such a kernel does not apply (dtypes, strides, a head size not a power of two, partial
        rotation)."""
        d = q.shape[2]
        if q.dtype == k.dtype == v.dtype == self.compute_dtype and q.stride(2) == k.stride(2) == v.stride(2) == 1 \
                and d & (d - 1) == 0 and rope.cos_sin.shape[1] == d:
            inv = (self._k_inv[layer], self._v_inv[layer]) if self.quantized else (None, None)
            return rope.cos_sin, rope.positions, *inv
        return None

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V (L, Hkv, D) at ``slots``: as stored, or dequantized to float32 when FP8."""
        k, v = self.k[layer][slots], self.v[layer][slots]
        if self.quantized:
            k = k.float() * self.k_scale[layer][:, None]
            v = v.float() * self.v_scale[layer][:, None]
        return k, v

    def kernel_scales(self, num_q_heads: int) -> list[tuple[dict[str, float], torch.Tensor | None,
                                                            torch.Tensor | None]]:
        """FP8: per layer, the attention kernels' ``k_scale`` / ``v_scale`` keywords when the layer's
        scales are one for every KV head, else none and the per-q-head multipliers of q (its KV
        head's k scale) and of the output (v scale)."""
        out = []
        group = num_q_heads // self.scales.k[0].numel()
        for k, v in zip(self.scales.k, self.scales.v, strict=True):
            if bool((k == k[0]).all()) and bool((v == v[0]).all()):
                out.append((dict(k_scale=float(k[0]), v_scale=float(v[0])), None, None))
            else:
                per_head = [s.repeat_interleave(group)[:, None].to(self.compute_dtype).to(self.device) for s in (k, v)]
                out.append(({}, *per_head))
        return out


def pool_slots_for_memory(bytes_budget: int, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """How many slots (padding slot included) a pool of these dimensions fits in ``bytes_budget``
    (``dtype``: what the pool stores — FP8 fits twice the tokens of bf16)."""
    bytes_per_slot = 2 * num_layers * kv_heads * head_dim * dtype.itemsize  # K and V
    return bytes_budget // bytes_per_slot
