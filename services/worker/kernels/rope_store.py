"""Rotary embedding and the K/V write in one launch (a layer's two small kernels become one: at
decode sizes each is mostly launch latency — on the H200 at batch 1 the rope and the KV write took
~1.6 and ~1.1 µs a layer plus a launch gap each).

One program per (token, head) of q and of k: q's heads are rotated in place; k's heads are rotated
in place and written with v's to the token's pool slot (quantized to e4m3 with the head's inverse
scale for an FP8 pool, saturated as ``kv.quantize_kv``). Rotate-half (neox) rope from the float32
[cos | sin] table at each token's position, computed in float32 and rounded once, as FlashInfer's
``apply_rope_with_cos_sin_cache_inplace``. Used only where ``check`` finds it agreeing with the
reference path on the device (``kv.set_rope_store_kernel``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.worker.kernels.triton_pdl import launch_pdl
from services.worker.numerics import FP8, FP8_MAX, cdiv

Tensor = torch.Tensor


@triton.jit
def _rope_store_kernel(q_ptr, k_ptr, v_ptr, kc_ptr, vc_ptr, slots_ptr, pos_ptr, cs_ptr, k_inv_ptr, v_inv_ptr,
                       T, HQ, q_stride_t, q_stride_h, k_stride_t, k_stride_h, v_stride_t, v_stride_h, c_stride_s,
                       c_stride_h, cs_stride, QUANT: tl.constexpr, FMAX: tl.constexpr, HALF: tl.constexpr,
                       BLOCK_T: tl.constexpr, PDL: tl.constexpr):
    """A program takes BLOCK_T tokens of one head (of q, or of k with its v): one at decode sizes, a tile of
    them for prompts (a 16k-token step is then ~20k programs, not 650k)."""
    if PDL:  # (launched overlapping the kernel before: nothing read until it has ended; the next may start)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    h = tl.program_id(1)
    live = t < T
    offs = tl.arange(0, HALF)[None, :]
    mask = live[:, None]
    row = cs_ptr + tl.load(pos_ptr + t, mask=live, other=0).to(tl.int64)[:, None] * cs_stride
    cos = tl.load(row + offs, mask=mask, other=0.0)
    sin = tl.load(row + HALF + offs, mask=mask, other=0.0)
    if h < HQ:
        at = q_ptr + t[:, None] * q_stride_t + h * q_stride_h
    else:
        at = k_ptr + t[:, None] * k_stride_t + (h - HQ) * k_stride_h
    x1 = tl.load(at + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(at + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    r1 = (x1 * cos - x2 * sin).to(q_ptr.dtype.element_ty)
    r2 = (x2 * cos + x1 * sin).to(q_ptr.dtype.element_ty)
    tl.store(at + offs, r1, mask=mask)
    tl.store(at + HALF + offs, r2, mask=mask)
    if h >= HQ:  # k's head: rotated K and V into the pool
        j = h - HQ
        dst = tl.load(slots_ptr + t, mask=live, other=0).to(tl.int64)[:, None] * c_stride_s + j * c_stride_h
        src = v_ptr + t[:, None] * v_stride_t + j * v_stride_h
        v1 = tl.load(src + offs, mask=mask, other=0.0)
        v2 = tl.load(src + HALF + offs, mask=mask, other=0.0)
        if QUANT:
            ki, vi = tl.load(k_inv_ptr + j), tl.load(v_inv_ptr + j)
            k1 = tl.minimum(tl.maximum(r1.to(tl.float32) * ki, -FMAX), FMAX)
            k2 = tl.minimum(tl.maximum(r2.to(tl.float32) * ki, -FMAX), FMAX)
            w1 = tl.minimum(tl.maximum(v1.to(tl.float32) * vi, -FMAX), FMAX)
            w2 = tl.minimum(tl.maximum(v2.to(tl.float32) * vi, -FMAX), FMAX)
        else:
            k1, k2, w1, w2 = r1, r2, v1, v2
        tl.store(kc_ptr + dst + offs, k1.to(kc_ptr.dtype.element_ty), mask=mask)
        tl.store(kc_ptr + dst + HALF + offs, k2.to(kc_ptr.dtype.element_ty), mask=mask)
        tl.store(vc_ptr + dst + offs, w1.to(vc_ptr.dtype.element_ty), mask=mask)
        tl.store(vc_ptr + dst + HALF + offs, w2.to(vc_ptr.dtype.element_ty), mask=mask)


ROWS_FROM = 64  # tokens from which a program takes ROWS_BLOCK of them (decode sizes: one token a program)
ROWS_BLOCK = 16


def rope_store(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor, cos_sin: Tensor,
               positions: Tensor, k_inv: Tensor | None = None, v_inv: Tensor | None = None) -> None:
    """q (T, Hq, D) and k (T, Hkv, D) rotated in place at ``positions`` (T,) by the float32 table
    ``cos_sin`` (P, D) = [cos | sin]; rotated k and v (T, Hkv, D) written at ``slots`` (T,) of the
    caches (S, Hkv, D) — scaled by ``k_inv`` / ``v_inv`` (Hkv,) and saturated when the pool is FP8.
    Unit stride along D everywhere; D a power of two."""
    t, hq, d = q.shape
    if not t:
        return
    hkv = k.shape[1]
    assert d == cos_sin.shape[1] and d & (d - 1) == 0 and q.stride(2) == k.stride(2) == v.stride(2) == 1
    assert k_cache.stride(2) == 1 and k_cache.stride() == v_cache.stride() and cos_sin.stride(1) == 1
    quant = k_inv is not None
    block, pdl = (ROWS_BLOCK, False) if t >= ROWS_FROM else (1, launch_pdl(q.device))  # (prompts: no PDL)
    _rope_store_kernel[(cdiv(t, block), hq + hkv)](
        q, k, v, k_cache, v_cache, slots, positions, cos_sin, k_inv if quant else cos_sin,
        v_inv if quant else cos_sin, t, hq, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0),
        v.stride(1), k_cache.stride(0), k_cache.stride(1), cos_sin.stride(0), QUANT=quant, FMAX=FP8_MAX,
        HALF=d // 2, BLOCK_T=block, PDL=pdl, num_warps=1 if block == 1 else 4,
        **({"launch_pdl": True} if pdl else {}))


def reference(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor, cos_sin: Tensor,
              positions: Tensor, k_inv: Tensor | None = None, v_inv: Tensor | None = None) -> None:
    """``rope_store`` in PyTorch (float32 rotation, one rounding; the same in-place contract)."""
    half = cos_sin.shape[1] // 2
    cos, sin = cos_sin[positions, :half][:, None, :], cos_sin[positions, half:][:, None, :]
    for x in (q, k):
        x1, x2 = x[..., :half].float(), x[..., half:].float()
        x.copy_(torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype))
    for cache, x, inv in ((k_cache, k, k_inv), (v_cache, v, v_inv)):
        if inv is None:
            cache.index_copy_(0, slots, x.to(cache.dtype))
        else:
            q8 = (x.float() * inv[None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
            cache.view(torch.uint8).index_copy_(0, slots, q8.view(torch.uint8))


def check(device: torch.device) -> bool:
    """The kernel against ``reference`` on ``device``: bf16 and fp16 pools (bit for bit but for a
    last-place rounding where float32 fused multiply-adds differ) and an FP8 pool (its values within
    an e4m3 step), on strided q/k/v views of one qkv tensor as the model passes them; decode sizes (a head a
    program) and prefill sizes (``ROWS_FROM`` tokens and more: token blocks, the last one partial)."""
    g = torch.Generator(device="cpu").manual_seed(3)
    hq, hkv, d, slots_n = 8, 2, 128, 256
    cos_sin = torch.randn(100, d, generator=g).to(device)
    for t, dtype, fp8 in ((13, torch.bfloat16, False), (13, torch.float16, False), (13, torch.bfloat16, True),
                          (ROWS_FROM + 37, torch.bfloat16, False), (ROWS_FROM + 37, torch.bfloat16, True)):
        positions = torch.randint(0, 100, (t,), generator=g).to(device)
        slots = torch.randperm(slots_n, generator=g)[:t].to(device)
        qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g).to(dtype).to(device)
        inv = (torch.rand(hkv, generator=g) + 0.5).to(device) if fp8 else None
        runs = []
        for fn in (rope_store, reference):
            x = qkv.clone()
            q = x[:, : hq * d].unflatten(-1, (hq, d))
            k = x[:, hq * d: (hq + hkv) * d].unflatten(-1, (hkv, d))
            v = x[:, (hq + hkv) * d:].unflatten(-1, (hkv, d))
            caches = [torch.zeros(slots_n, hkv, d, dtype=FP8 if fp8 else dtype, device=device) for _ in range(2)]
            fn(q, k, v, *caches, slots, cos_sin, positions, inv, inv)
            runs.append((x, *caches))
        for i, (got, want) in enumerate(zip(runs[0], runs[1], strict=True)):  # qkv, then the caches
            got, want = got.float(), want.float()
            tol = want.abs() * 0.13 + 2**-9 if fp8 and i else want.abs() * 2**-6 + 1e-6
            if not bool(((got - want).abs() <= tol).all()):
                return False
    return True
