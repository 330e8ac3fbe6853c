"""Fused CUDA kernels (Triton) for the FP8 paths, each replacing several PyTorch ops (one launch
each, which under CUDA graphs is what a decode step pays for):

- ``per_token_quant``: activations (T, K) → e4m3 (T, K) and one scale per token (T, 1), in one pass
  over each row for the max and one for the scaled cast (the row is in L2 the second time);
- ``add_rmsnorm_quant`` / ``silu_mul_quant``: the add-RMSNorm before q/k/v and gate/up, the SiLU-and-multiply
  before down, writing their output quantized per token (the row rounded to the activations' dtype first, as the
  separate op stores it, then scaled and cast) — one kernel in place of the op and ``per_token_quant``, and no
  bf16 row written and read back in between (``fp8.FusedQuant``);
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

from services.worker.numerics import pow2_at_least
from services.worker.quant.fp8 import FP8, FP8_MAX, FusedQuant, QuantizedActivation, quantize_per_token
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
    return _quant_rows(_per_token_quant_kernel, x, x.shape[1], out_dtype)


def _quant_rows(kernel, src: Tensor, width: int, out_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """A program a row of ``src`` (T, ·) writing ``width`` quantized values and the row's scale → (q, scale (T, 1))."""
    t = src.shape[0]
    if src.stride(1) != 1:
        src = src.contiguous()
    q = torch.empty((t, width), dtype=out_dtype, device=src.device)
    s = torch.empty((t, 1), dtype=torch.float32, device=src.device)
    if t:
        block = min(4096, pow2_at_least(width))
        kernel[(t,)](src, q, s, width, src.stride(0), q.stride(0), FMAX=FP8_MAX, TINY=_TINY, BLOCK=block,
                     num_warps=4 if block <= 1024 else 8)
    return q, s


@triton.jit
def _add_rmsnorm_quant_kernel(x_ptr, r_ptr, w_ptr, q_ptr, s_ptr, r_out_ptr, K, stride_x, stride_r, stride_q,
                              stride_ro, eps, HAS_RES: tl.constexpr, FMAX: tl.constexpr, TINY: tl.constexpr,
                              BLOCK: tl.constexpr):
    """A row: x (+ residual, stored rounded as the new residual) in fp32, normalized, times the weight, rounded to
    x's dtype as the norm kernels store it; then its max, scale and e4m3 cast (FlashInfer's order of rounding)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < K
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    dtype = x.dtype
    x = x.to(tl.float32)
    if HAS_RES:
        x += tl.load(r_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(r_out_ptr + row * stride_ro + offs, x.to(dtype), mask=mask)
    rrms = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / K + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = (x * rrms * w).to(dtype).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(y), axis=0) / FMAX, TINY)
    tl.store(s_ptr + row, scale)
    q = tl.minimum(tl.maximum(y / scale, -FMAX), FMAX)
    tl.store(q_ptr + row * stride_q + offs, q.to(q_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_row(h_row, offs, mask, I):
    g = tl.load(h_row + offs, mask=mask, other=0.0)
    u = tl.load(h_row + I + offs, mask=mask, other=0.0).to(tl.float32)
    gf = g.to(tl.float32)
    return (gf / (1.0 + tl.exp(-gf)) * u).to(g.dtype).to(tl.float32)


@triton.jit
def _silu_mul_quant_kernel(h_ptr, q_ptr, s_ptr, I, stride_h, stride_q, FMAX: tl.constexpr, TINY: tl.constexpr,
                           BLOCK: tl.constexpr):
    """A row of h = [gate | up]: silu(gate) · up rounded to h's dtype (as the activation kernel stores it), its
    max over the row, then the same values again (the row is in L2 by then) scaled and cast."""
    row = tl.program_id(0).to(tl.int64)
    h_row, q_row = h_ptr + row * stride_h, q_ptr + row * stride_q
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, I, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        amax = tl.maximum(amax, tl.abs(_silu_mul_row(h_row, offs, offs < I, I)))
    scale = tl.maximum(tl.max(amax, axis=0) / FMAX, TINY)
    tl.store(s_ptr + row, scale)
    for start in range(0, I, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        q = tl.minimum(tl.maximum(_silu_mul_row(h_row, offs, offs < I, I) / scale, -FMAX), FMAX)
        tl.store(q_row + offs, q.to(q_ptr.dtype.element_ty), mask=offs < I)


NORM_QUANT_MAX_K = 16384  # (a row in one program's registers: up to 64 values a thread at 8 warps)


def add_rmsnorm_quant(x: Tensor, residual: Tensor | None, weight: Tensor, eps: float, out_dtype: torch.dtype = FP8
                      ) -> tuple[QuantizedActivation, Tensor] | None:
    """x, residual (T, K) → (rmsnorm(x + residual) · weight quantized per token, x + residual (a new tensor));
    without a residual the second is x. None for rows longer than ``NORM_QUANT_MAX_K``."""
    t, k = x.shape
    if k > NORM_QUANT_MAX_K:
        return None
    if x.stride(1) != 1:
        x = x.contiguous()
    q = torch.empty((t, k), dtype=out_dtype, device=x.device)
    s = torch.empty((t, 1), dtype=torch.float32, device=x.device)
    r_out = x if residual is None else torch.empty_like(x)
    r_in = x if residual is None else (residual if residual.stride(1) == 1 else residual.contiguous())
    if t:
        block = pow2_at_least(k)
        _add_rmsnorm_quant_kernel[(t,)](x, r_in, weight, q, s, r_out, k, x.stride(0), r_in.stride(0), q.stride(0),
                                        r_out.stride(0), eps, HAS_RES=residual is not None, FMAX=FP8_MAX, TINY=_TINY,
                                        BLOCK=block, num_warps=4 if block <= 2048 else 8)
    return QuantizedActivation(q, s, x.dtype), r_out


def silu_mul_quant(h: Tensor, out_dtype: torch.dtype = FP8) -> QuantizedActivation:
    """h (T, 2I) = [gate | up] → silu(gate) · up (T, I) quantized per token."""
    return QuantizedActivation(*_quant_rows(_silu_mul_quant_kernel, h, h.shape[1] // 2, out_dtype), h.dtype)


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
                               k_cache.stride(1), QUANT=quant, FMAX=FP8_MAX, BLOCK_D=pow2_at_least(d))


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


def _reference_norm_quant(x: Tensor, residual: Tensor | None, weight: Tensor, eps: float
                          ) -> tuple[tuple[Tensor, Tensor], Tensor]:
    """The add-RMSNorm as FlashInfer computes it (fp32, one rounding), then ``quantize_per_token``."""
    xf = x.float() if residual is None else x.float() + residual.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)
    return quantize_per_token(y), xf.to(x.dtype)


def _close(got: QuantizedActivation, want: tuple[Tensor, Tensor]) -> bool:
    """The same dequantized values up to e4m3's rounding (a row's max may differ by an ulp of its dtype)."""
    deq, ref = got.q.float() * got.scale, want[0].float() * want[1]
    return bool(torch.allclose(got.scale, want[1], rtol=1e-2, atol=0)
                and ((deq - ref).abs() <= ref.abs() * 0.15 + want[1] * 2**-6).all())


def check_fused_quant(device: torch.device) -> FusedQuant | None:
    """The add-RMSNorm and SiLU-and-multiply kernels that quantize as they write, against the op then
    ``quantize_per_token`` (bf16 and fp16; with and without a residual; strided rows; an all-zero row) → the
    ``FusedQuant`` to use, or None where they disagree."""
    g = torch.Generator(device="cpu").manual_seed(3)
    for dtype in (torch.bfloat16, torch.float16):
        x = (torch.randn(19, 4096 + 64, generator=g) * torch.logspace(-2, 2, 19)[:, None]).to(dtype).to(device)
        r = torch.randn(19, 4096 + 64, generator=g).to(dtype).to(device)
        x[3], r[3] = 0, 0
        w = (1 + torch.randn(4096, generator=g) / 4).to(dtype).to(device)
        for res in (r[:, :4096], None):
            got, got_r = add_rmsnorm_quant(x[:, :4096], res, w, 1e-6)
            want, want_r = _reference_norm_quant(x[:, :4096], res, w, 1e-6)
            if not (torch.equal(got_r, want_r) and _close(got, want)):
                return None
        h = (torch.randn(19, 2 * 5000 + 8, generator=g) * 3).to(dtype).to(device)[:, :10000]
        gate, up = h.float().chunk(2, dim=-1)
        if not _close(silu_mul_quant(h), quantize_per_token((torch.nn.functional.silu(gate) * up).to(dtype))):
            return None
    return FusedQuant(add_rmsnorm_quant, silu_mul_quant)


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
