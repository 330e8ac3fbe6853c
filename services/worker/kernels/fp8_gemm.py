"""FP8 GEMMs beyond the small-M kernels' rows (M > ``MAX_M``: decode batches, mixed steps): y = (xq · sx)(wq · sw)^T
on FP8 tensor cores, the per-token scales sx (M, 1) and per-channel scales sw (N,) applied in the epilogue, in
Triton — chosen per weight shape and range of M at start-up only where it measured correct and ≥ 3 % faster than
``torch._scaled_mm`` (cuBLASLt's row-wise scaled kernels) on the same quantized activations: never slower.

Why: in W2 with FP8 weights the decode steps gained nothing over bf16 (~90-row graphs 9.8 vs 10.3 ms, ~600-row
piecewise steps 42.0 vs 40.9 ms; docs/perf.md 2026-12-05) where half the weight bytes and twice the tensor-core
rate should save ~1.8 and ~6 ms: the library's kernel at those M is the suspect (``small_m_bench --library-only``
times it). A program computes a ``block_m`` × ``block_n`` tile over the whole K (no split: the same bits every
run), programs ordered in groups of ``group_m`` row tiles so that neighbours share a weight tile (read from HBM
once, from L2 by the rest). Both operands are loaded K-major, as Hopper's FP8 ``wgmma`` needs them. The tensor
cores' reduced-precision accumulation is promoted to the float32 sums every ``block_k`` products, as cuBLAS does
without fast accumulation — or never with ``BANYAN_FP8_FAST_ACCUM=1``, the library's setting followed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from services.worker import kernels
from services.worker.quant.fp8 import fast_accum

Tensor = torch.Tensor
# M ranges with a choice of their own, each timed at its top (above the last: the library)
BUCKETS = (32, 64, 128, 256, 512, 1024, 2048, 4096, 16384)


@triton.jit(do_not_specialize=["M"])  # (one compiled kernel for every M: start-up compiles what a step will run)
def _w8a8_kernel(a_ptr, b_ptr, sa_ptr, sb_ptr, c_ptr, M, N, K, stride_a, stride_b, stride_c, EVEN_K: tl.constexpr,
                 PRECISE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * tiles_n
    first_m = (pid // in_group) * GROUP_M
    group_m = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_m  # (row tiles fastest: neighbours share the weight tile)
    pid_n = (pid % in_group) // group_m
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    a_at = a_ptr + rm[:, None].to(tl.int64) * stride_a + rk[None, :]
    b_at = b_ptr + rn[:, None].to(tl.int64) * stride_b + rk[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_at, mask=rm[:, None] < M, other=0.0)
            b = tl.load(b_at, mask=rn[:, None] < N, other=0.0)
        else:
            a = tl.load(a_at, mask=(rm[:, None] < M) & (rk[None, :] < K - k0), other=0.0)
            b = tl.load(b_at, mask=(rn[:, None] < N) & (rk[None, :] < K - k0), other=0.0)
        if PRECISE:  # (a tile's products summed on the tensor cores, then added to the float32 sums)
            acc = tl.dot(a, tl.trans(b), acc, max_num_imprecise_acc=BLOCK_K)
        else:  # (Hopper's reduced-precision accumulation over all of K: fast accumulation)
            acc = tl.dot(a, tl.trans(b), acc)
        a_at += BLOCK_K
        b_at += BLOCK_K
    sa = tl.load(sa_ptr + rm, mask=rm < M, other=0.0)
    sb = tl.load(sb_ptr + rn, mask=rn < N, other=0.0)
    y = acc * sa[:, None] * sb[None, :]
    tl.store(c_ptr + rm[:, None].to(tl.int64) * stride_c + rn[None, :], y.to(c_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


@dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    warps: int = 4
    stages: int = 4
    group_m: int = 8

    def __str__(self) -> str:
        return f"w8a8_{self.block_m}x{self.block_n}x{self.block_k}w{self.warps}s{self.stages}g{self.group_m}"


# 64-row tiles (one warpgroup's wgmma) for decode batches, where the weight read dominates — narrow ones for the
# 4,096-row weights, so that enough programs read; 128-row tiles with wide N for mixed steps, where the tensor cores
# do; shared memory a stage is (block_m + block_n) × block_k bytes
CONFIGS = (GemmConfig(64, 64, 128), GemmConfig(64, 128, 128), GemmConfig(64, 64, 256, stages=3),
           GemmConfig(64, 32, 256),  # (N = 4,096 at ≤ 64 rows: 128 programs, not 64 — every SM streaming weight)
           GemmConfig(64, 128, 256, warps=8, stages=3), GemmConfig(128, 64, 128), GemmConfig(128, 128, 128, warps=8),
           GemmConfig(128, 256, 128, warps=8, stages=3), GemmConfig(128, 128, 64, warps=8, stages=5))


def matmul(xq: Tensor, xs: Tensor, w: Tensor, ws: Tensor, out_dtype: torch.dtype, cfg: GemmConfig = CONFIGS[0]
           ) -> Tensor:
    """xq (M, K) e4m3 with xs (M, 1) float32, w (N, K) e4m3 with ws (N,) float32 → (xq·xs)(w·ws)^T (M, N)."""
    m, k = xq.shape
    n = w.shape[0]
    assert w.shape[1] == k and xq.stride(1) == 1 and w.stride(1) == 1
    y = torch.empty((m, n), dtype=out_dtype, device=xq.device)
    if m:
        grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
        _w8a8_kernel[grid](xq, w, xs, ws, y, m, n, k, xq.stride(0), w.stride(0), y.stride(0),
                           EVEN_K=k % cfg.block_k == 0, PRECISE=not fast_accum(), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                           BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, num_warps=cfg.warps, num_stages=cfg.stages)
    return y


LOGITS_MAX_M = 1024  # (a vocabulary-wide weight multiplies a step's sampled rows only: its ranges stop here)


def tune(weights: list[tuple[Tensor, Tensor]], dtype: torch.dtype) -> dict[str, str]:
    """For each distinct (N, K) of the FP8 ``weights`` ((weight, per-row scale) on a CUDA device) and each M range
    of ``BUCKETS`` (timed at its top, in CUDA graphs over weight copies larger than the L2 cache, as a step reads
    them): the fastest config that is correct (against float32 on the dequantized operands) and ≥ 3 % faster than
    ``torch._scaled_mm`` on the same quantized activations, else the library → {"NxK": what won, per range}."""
    from services.worker.kernels.small_m import L2_SPAN, _close, _time, fastest, verdict
    from services.worker.quant import fp8

    report: dict[str, str] = {}
    for w, s in weights:
        n, k = w.shape
        key, name = (n, k), f"{n}x{k}"
        if name in report:
            continue
        if key in kernels.fp8_gemm_tuned:  # (decided earlier in this process: kept)
            report[name] = kernels.fp8_gemm_tuned[key]
            continue
        copies = max(1, min(16, -(-L2_SPAN // w.numel())))
        wc = [w] + [w.clone() for _ in range(copies - 1)]
        deq = w.float() * s.float()[:, None]
        picks, said = [], []
        for top in BUCKETS if n < 65536 else [b for b in BUCKETS if b <= LOGITS_MAX_M]:
            xa = fp8.quantize_activation(torch.randn(top, k, dtype=dtype, device=w.device))
            want = (xa.q.float() * xa.scale) @ deq.t()
            base = _time(lambda i: fp8.library_gemm(xa, wc[i], s), copies)
            best, best_t = fastest(
                CONFIGS, base, lambda cfg: _close(matmul(xa.q, xa.scale, w, s, dtype, cfg).float(), want),
                lambda cfg: _time(lambda i: matmul(xa.q, xa.scale, wc[i], s, dtype, cfg), copies))
            picks.append((top, best))
            said.append(verdict(top, best, best_t, base))
        if any(cfg is not None for _, cfg in picks):
            kernels.fp8_gemm_choices[key] = tuple(picks)
        report[name] = kernels.fp8_gemm_tuned[key] = "; ".join(said)
    return report


def tune_model(model: torch.nn.Module, dtype: torch.dtype) -> dict[str, str]:
    """``tune`` over the model's FP8 linear layers (``quantized()`` with an e4m3 weight)."""
    from services.worker.quant.fp8 import FP8

    weights = [mod.quantized() for mod in model.modules() if hasattr(mod, "quantized")]
    with torch.inference_mode():
        return tune([(w, s) for w, s in weights if w.dtype == FP8 and s is not None and w.dim() == 2], dtype)
