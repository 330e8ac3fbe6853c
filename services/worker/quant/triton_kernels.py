"""Fused CUDA kernels (Triton) for the FP8 paths, each replacing several PyTorch ops (one launch
each, which under CUDA graphs is what a decode step pays for):

- ``per_token_quant``: activations (T, K) → e4m3 (T, K) and one scale per token (T, 1), in one pass
  over each row for the max and one for the scaled cast (the row is in L2 the second time);
- ``store_kv``: the new tokens' K and V (T, Hkv, D), possibly strided views of the qkv projection,
  scaled per head, saturated, cast to e4m3 and written at their slots of the pool — one launch for
  both (a plain write is two ``index_copy_``; the PyTorch quantized write is eight ops).

The worker uses them only after ``check_*`` compared them with the PyTorch reference on the device
(``quant.enable_cuda_kernels``). Both cast to their output's element type, so the CPU tests run
them in Triton's interpreter with float32 outputs (its emulated fp8 cast does not round as the GPU does).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.worker.quant.fp8 import FP8, FP8_MAX, quantize_per_token
from services.worker.quant.kv import quantize_kv

Tensor = torch.Tensor
_TINY = 1e-12


@triton.jit
def _per_token_quant_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, FMAX: tl.constexpr, TINY: tl.constexpr,
                            BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row, q_row = x_ptr + row * stride_x, q_ptr + row * stride_q
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, K, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, axis=0) / FMAX, TINY)
    tl.store(s_ptr + row, scale)
    for start in range(0, K, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(x / scale, -FMAX), FMAX)
        tl.store(q_row + offs, q.to(q_ptr.dtype.element_ty), mask=offs < K)


def per_token_quant(x: Tensor, out_dtype: torch.dtype = FP8) -> tuple[Tensor, Tensor]:
    """x (T, K), rows contiguous → (q (T, K) ``out_dtype``, scale (T, 1) float32): x ≈ q * scale."""
    t, k = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    q = torch.empty((t, k), dtype=out_dtype, device=x.device)
    s = torch.empty((t, 1), dtype=torch.float32, device=x.device)
    if t:
        block = min(4096, triton.next_power_of_2(k))
        _per_token_quant_kernel[(t,)](x, q, s, k, x.stride(0), q.stride(0), FMAX=FP8_MAX, TINY=_TINY, BLOCK=block,
                                      num_warps=4 if block <= 1024 else 8)
    return q, s


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slots_ptr, k_inv_ptr, v_inv_ptr, D, k_stride_t, k_stride_h,
                     v_stride_t, v_stride_h, c_stride_s, c_stride_h, QUANT: tl.constexpr, FMAX: tl.constexpr,
                     BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    dst = slot * c_stride_s + h * c_stride_h + offs
    k = tl.load(k_ptr + t * k_stride_t + h * k_stride_h + offs, mask=mask, other=0.0)
    v = tl.load(v_ptr + t * v_stride_t + h * v_stride_h + offs, mask=mask, other=0.0)
    if QUANT:  # scaled and saturated to e4m3's range (else: copied as they are)
        k = tl.minimum(tl.maximum(k.to(tl.float32) * tl.load(k_inv_ptr + h), -FMAX), FMAX)
        v = tl.minimum(tl.maximum(v.to(tl.float32) * tl.load(v_inv_ptr + h), -FMAX), FMAX)
    tl.store(kc_ptr + dst, k.to(kc_ptr.dtype.element_ty), mask=mask)
    tl.store(vc_ptr + dst, v.to(vc_ptr.dtype.element_ty), mask=mask)


def store_kv(k_cache: Tensor, v_cache: Tensor, slots: Tensor, k: Tensor, v: Tensor, k_inv: Tensor | None = None,
             v_inv: Tensor | None = None) -> None:
    """``kv.store_fp8`` in one launch: k, v (T, Hkv, D) with unit stride along D; caches (S, Hkv, D).
    Without scales: K and V copied unchanged (a bf16/fp16 pool's write, one launch instead of two)."""
    t, hkv, d = k.shape
    if not t:
        return
    assert k.stride(2) == 1 and v.stride(2) == 1 and k_cache.stride(2) == 1 and k_cache.stride() == v_cache.stride()
    quant = k_inv is not None
    _store_kv_kernel[(t, hkv)](k, v, k_cache, v_cache, slots, k_inv if quant else k, v_inv if quant else v, d,
                               k.stride(0), k.stride(1), v.stride(0), v.stride(1), k_cache.stride(0),
                               k_cache.stride(1), QUANT=quant, FMAX=FP8_MAX, BLOCK_D=triton.next_power_of_2(d))


# --- checks against the PyTorch reference, on the device, at start-up ----------------------------------


def check_per_token_quant(device: torch.device) -> bool:
    g = torch.Generator(device="cpu").manual_seed(0)
    x = (torch.randn(37, 4096 + 64, generator=g) * torch.logspace(-3, 3, 37)[:, None]).to(torch.bfloat16)
    x[5] = 0  # an all-zero row
    x = x.to(device)
    q, s = per_token_quant(x)
    q_ref, s_ref = quantize_per_token(x)
    same_scale = torch.allclose(s, s_ref, rtol=1e-6, atol=0)
    # the same e4m3 value, or its neighbour where x / s rounds differently by an ulp in fp32
    close = ((q.float() - q_ref.float()).abs() <= q_ref.float().abs() * 0.13 + 2**-9).all()
    return bool(same_scale and close)


def check_store_kv_plain(device: torch.device) -> bool:
    """The unscaled write: bit for bit what two ``index_copy_`` write (bf16 and fp16, strided views)."""
    g = torch.Generator(device="cpu").manual_seed(2)
    t, hkv, d = 13, 4, 128
    for dtype in (torch.bfloat16, torch.float16):
        qkv = torch.randn(t, (8 + 2 * hkv) * d, generator=g).to(dtype).to(device)
        k, v = qkv[:, 8 * d:(8 + hkv) * d].unflatten(-1, (hkv, d)), qkv[:, (8 + hkv) * d:].unflatten(-1, (hkv, d))
        slots = torch.randperm(64, generator=g)[:t].to(device)
        caches = [torch.zeros(64, hkv, d, dtype=dtype, device=device) for _ in range(4)]
        store_kv(caches[0], caches[1], slots, k, v)
        caches[2].index_copy_(0, slots, k)
        caches[3].index_copy_(0, slots, v)
        if not (torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])):
            return False
    return True


def check_store_kv(device: torch.device) -> bool:
    g = torch.Generator(device="cpu").manual_seed(1)
    t, hkv, d = 13, 4, 128
    qkv = (torch.randn(t, (8 + 2 * hkv) * d, generator=g) * 20).to(torch.bfloat16).to(device)
    k = qkv[:, 8 * d:(8 + hkv) * d].unflatten(-1, (hkv, d))  # strided views, as the model passes them
    v = qkv[:, (8 + hkv) * d:].unflatten(-1, (hkv, d))
    slots = torch.randperm(64, generator=g)[:t].to(device)
    k_inv = torch.rand(hkv, generator=g).add_(0.5).to(device)
    v_inv = torch.rand(hkv, generator=g).add_(0.5).to(device)
    caches = [torch.zeros(64, hkv, d, dtype=FP8, device=device) for _ in range(4)]
    store_kv(caches[0], caches[1], slots, k, v, k_inv, v_inv)
    caches[2].view(torch.uint8).index_copy_(0, slots, quantize_kv(k, k_inv).view(torch.uint8))
    caches[3].view(torch.uint8).index_copy_(0, slots, quantize_kv(v, v_inv).view(torch.uint8))
    return all(bool((a.float() - b.float()).abs().le(b.float().abs() * 0.13 + 2**-9).all())
               for a, b in ((caches[0], caches[2]), (caches[1], caches[3])))
