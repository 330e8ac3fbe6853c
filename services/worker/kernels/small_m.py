"""Linear layers at decode batch sizes (M ≤ ``MAX_M`` rows): y = x W^T (· scale per output row).

At M = 1–16 a linear is a read of its weight: the floor is weight bytes ÷ HBM bandwidth. The
library paths are not built for it: cuBLAS's bf16 GEMV reaches ~80 % of copy bandwidth on the H200,
and FP8 weights through ``torch._scaled_mm`` pay a per-token activation quantization and ran
*slower* than bf16 at M = 1 (docs/perf.md). This kernel streams the weight once, whatever its
element type (bf16/fp16, or e4m3 dequantized in registers with its per-row scale: weight-only FP8,
the activations stay in their dtype), with the M rows padded to one 16-row tensor-core tile.

Grid: one program per ``BLOCK_N`` output rows, each reading its rows' whole K (no split-K: atomics
would sum in a different order each run, and greedy outputs must not depend on it — each output row
is also computed the same way whatever M is, so a padded graph batch and an eager one agree
bit for bit). ``tune`` times a few configs against the library path for each weight shape of the
model at start-up and records the winner per (N, K); ``linear`` is used only for shapes where the
kernel won (``kernels.choices``): never slower.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from services.worker import kernels
from services.worker.kernels import MAX_M

Tensor = torch.Tensor


@triton.jit
def _small_m_kernel(x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, stride_x, stride_w, stride_y,
                    HAS_SCALE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rm[:, None] * stride_x + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K),
                    other=0.0)
        w = tl.load(w_ptr + rn[:, None].to(tl.int64) * stride_w + rk[None, :],
                    mask=(rn[:, None] < N) & (rk[None, :] < K), other=0.0)
        acc += tl.dot(x, tl.trans(w.to(x_ptr.dtype.element_ty)))
    if HAS_SCALE:
        acc = acc * tl.load(s_ptr + rn, mask=rn < N, other=0.0)[None, :]
    tl.store(y_ptr + rm[:, None] * stride_y + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


@dataclass(frozen=True)
class Config:
    block_n: int
    block_k: int
    warps: int = 4
    stages: int = 3


CONFIGS = (Config(16, 256), Config(32, 256), Config(16, 512, warps=8), Config(64, 128, stages=4))


def linear(x: Tensor, w: Tensor, scale: Tensor | None = None, cfg: Config = CONFIGS[1]) -> Tensor:
    """x (M ≤ MAX_M, K) @ w (N, K)^T, times ``scale`` (N,) per output row if given → (M, N) in x's dtype."""
    m, k = x.shape
    n = w.shape[0]
    assert m <= MAX_M and w.shape[1] == k and w.stride(1) == 1
    if x.stride(1) != 1:
        x = x.contiguous()
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    _small_m_kernel[(triton.cdiv(n, cfg.block_n),)](
        x, w, scale if scale is not None else w, y, m, n, k, x.stride(0), w.stride(0), y.stride(0),
        HAS_SCALE=scale is not None, BLOCK_M=16, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, num_warps=cfg.warps,
        num_stages=cfg.stages)
    return y


# --- which shapes use it: measured on the device at start-up -------------------------------------------


def _time(fn, reps: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps


def tune(weights: list[tuple[Tensor, Tensor | None]], library, dtype: torch.dtype) -> dict[str, str]:
    """For each distinct (N, K, dtype) of ``weights`` ((weight, scale or None) pairs on a CUDA
    device): time each config against the library path (``library(x, w, scale)``) at M = 1 and
    M = ``MAX_M``; keep the fastest correct one that beats the library by 3 % at M = 1 and is no
    slower at ``MAX_M``. → {"NxK dtype": what won (µs at M = 1)}."""
    report: dict[str, str] = {}
    seen: set[tuple[int, int, torch.dtype]] = set()
    for w, s in weights:
        n, k = w.shape
        key = (n, k, w.dtype)
        name = f"{n}x{k} {str(w.dtype).removeprefix('torch.')}"
        if key in seen:
            continue
        seen.add(key)
        if key in kernels.tuned:  # (decided earlier in this process: kept)
            report[name] = kernels.tuned[key]
            continue
        xs = [torch.randn(m, k, dtype=dtype, device=w.device) / k**0.5 for m in (1, MAX_M)]
        wants = [library(x, w, s).float() for x in xs]
        base = [_time(lambda x=x: library(x, w, s)) for x in xs]
        best, best_t = None, None
        for cfg in CONFIGS:
            try:
                if not all(_close(linear(x, w, s, cfg).float(), want) for x, want in zip(xs, wants)):
                    continue
                t = [_time(lambda x=x, cfg=cfg: linear(x, w, s, cfg)) for x in xs]
            except Exception:  # (a config the compiler rejects on this device)
                continue
            if t[0] < base[0] / 1.03 and t[1] <= base[1] and (best_t is None or t[0] < best_t[0]):
                best, best_t = cfg, t
        if best is not None:
            kernels.choices[key] = best
        report[name] = kernels.tuned[key] = (
            f"kernel {best_t[0] * 1e6:.1f} us vs library {base[0] * 1e6:.1f} us ({best})" if best
            else f"library {base[0] * 1e6:.1f} us")
    return report


def _close(got: Tensor, want: Tensor) -> bool:
    return bool(torch.allclose(got, want, rtol=2e-2, atol=2e-2 * float(want.abs().max()) + 1e-6))


def tune_model(model: torch.nn.Module, dtype: torch.dtype) -> dict[str, str]:
    """``tune`` over the model's linear layers (those with ``quantized()``: weight, scale or None),
    against cuBLAS (bf16/fp16 weights) or the FP8 library path (e4m3 weights)."""
    import torch.nn.functional as F

    from services.worker.quant.fp8 import FP8, library_fp8_linear

    weights = [mod.quantized() for mod in model.modules() if hasattr(mod, "quantized")]
    fp8 = [(w, s) for w, s in weights if w.dtype == FP8]
    plain = [(w, None) for w, s in weights if w.dtype != FP8 and w.dim() == 2]
    with torch.inference_mode():
        report = tune(plain, lambda x, w, s: F.linear(x, w), dtype)
        report.update(tune(fp8, library_fp8_linear, dtype))
    return report
