"""GEMMs beyond the small-M kernels' rows (decode batches, mixed steps), in Triton, each chosen per weight shape and
range of M at start-up only where it measured correct and ≥ 3 % faster than the library on the same operands —
never slower:

- FP8: y = (xq · sx)(wq · sw)^T on FP8 tensor cores, the per-token scales sx (M, 1) and per-channel scales sw (N,)
  applied in the epilogue, against ``torch._scaled_mm`` (cuBLASLt's row-wise scaled kernels);
- bf16/fp16: y = x w^T against cuBLAS (``F.linear``), up to ``PLAIN_MAX_M`` rows (decode batches: a read of the
  weight at ~79 % of HBM bandwidth by cuBLAS at M = 64; above, the GEMMs are compute-bound and cuBLAS's).

Why: in W2 with FP8 weights the decode steps gained nothing over bf16 (~90-row graphs 9.8 vs 10.3 ms, ~600-row
piecewise steps 42.0 vs 40.9 ms) where half the weight bytes and twice the tensor-core rate should save ~1.8 and
~6 ms: the library's kernel at those M is the suspect (``small_m_bench --library-only`` times it). A program
computes a ``block_m`` × ``block_n`` tile over the whole K; programs are ordered in groups of ``group_m`` row tiles so that neighbours share a weight tile (read from HBM
once, from L2 by the rest). Both operands are loaded K-major, as Hopper's FP8 ``wgmma`` needs them. The tensor
cores' reduced-precision FP8 accumulation is promoted to the float32 sums every ``block_k`` products, as cuBLAS
does without fast accumulation — with ``BANYAN_FP8_FAST_ACCUM=0``; by default never, the library's setting followed.
``BANYAN_GEMM=0``: none of it; ``=fp8``: FP8 weights only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from services.worker import kernels
from services.worker.kernels import tuning_cache
from services.worker.numerics import FP8, cdiv, fast_accum

Tensor = torch.Tensor
# M ranges with a choice of their own, each timed at its top (above the last: the library)
BUCKETS = (32, 64, 128, 256, 512, 1024, 2048, 4096, 16384)
PLAIN_MAX_M = 1024  # (bf16/fp16 weights: cuBLAS above)
LOGITS_MAX_M = 1024  # (a vocabulary-wide weight multiplies a step's sampled rows only: its ranges stop here)


@triton.jit(do_not_specialize=["M"])  # (one compiled kernel for every M: start-up compiles what a step will run)
def _gemm_kernel(a_ptr, b_ptr, sa_ptr, sb_ptr, c_ptr, M, N, K, stride_a, stride_b, stride_c,
                 SCALED: tl.constexpr, EVEN_K: tl.constexpr, PRECISE: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
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
        if SCALED and PRECISE:  # (an FP8 tile's products summed on the tensor cores, then added to the float32 sums)
            acc = tl.dot(a, tl.trans(b), acc, max_num_imprecise_acc=BLOCK_K)
        else:  # (FP8: Hopper's reduced-precision accumulation over all of K, fast accumulation)
            acc = tl.dot(a, tl.trans(b), acc)
        a_at += BLOCK_K
        b_at += BLOCK_K
    if SCALED:
        acc = acc * tl.load(sa_ptr + rm, mask=rm < M, other=0.0)[:, None]
        acc = acc * tl.load(sb_ptr + rn, mask=rn < N, other=0.0)[None, :]
    tl.store(c_ptr + rm[:, None].to(tl.int64) * stride_c + rn[None, :], acc.to(c_ptr.dtype.element_ty),
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
        return f"gemm_{self.block_m}x{self.block_n}x{self.block_k}w{self.warps}s{self.stages}g{self.group_m}"


# 64-row tiles (one warpgroup's wgmma) for decode batches, where the weight read dominates — narrow ones for the
# 4,096-row weights, so that enough programs read; 128-row tiles for mixed steps, where the tensor cores do; shared
# memory a stage is (block_m + block_n) × block_k × the element size. Each config here won a shape in a recorded
# start-up (benchmarks/results/*: ``M≤n: gemm_... us vs library``); the ones that never did were removed
# (docs/decisions/0007-tuner-configs-that-never-won.md).
CONFIGS = (GemmConfig(64, 64, 128), GemmConfig(64, 64, 256, stages=3),
           GemmConfig(64, 64, 128, stages=6),  # (deeper: more weight bytes in flight an SM, for the memory-bound rows)
           GemmConfig(64, 32, 256),  # (N = 4,096 at ≤ 64 rows: 128 programs, not 64 — every SM streaming weight)
           GemmConfig(64, 128, 256, warps=8, stages=3))
PLAIN_CONFIGS = (GemmConfig(64, 128, 64), GemmConfig(64, 64, 128, stages=3), GemmConfig(64, 128, 64, stages=5),
                 GemmConfig(128, 64, 64), GemmConfig(128, 128, 64, warps=8, stages=3))
EDGE_ROWS = 256  # (above 512 rows the check compares the first and last this many with float32: the tiles repeat)


def matmul(x: Tensor, w: Tensor, out_dtype: torch.dtype, cfg: GemmConfig = CONFIGS[0],
           xs: Tensor | None = None, ws: Tensor | None = None) -> Tensor:
    """x (M, K) @ w (N, K)^T → (M, N): bf16/fp16 operands, or e4m3 ones with xs (M, 1) and ws (N,) float32 scales
    (then (x·xs)(w·ws)^T)."""
    m, k = x.shape
    n = w.shape[0]
    assert w.shape[1] == k and w.stride(1) == 1 and (xs is None) == (ws is None)
    if x.stride(1) != 1:
        x = x.contiguous()
    y = torch.empty((m, n), dtype=out_dtype, device=x.device)
    if m:
        scaled = xs is not None
        sa, sb = (xs, ws) if scaled else (x, w)
        grid = (cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n),)
        _gemm_kernel[grid](x, w, sa, sb, y, m, n, k, x.stride(0), w.stride(0), y.stride(0), SCALED=scaled,
                           EVEN_K=k % cfg.block_k == 0, PRECISE=not fast_accum(), BLOCK_M=cfg.block_m,
                           BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
                           num_warps=cfg.warps, num_stages=cfg.stages)
    return y


def tune(weights: list[tuple[Tensor, Tensor | None]], dtype: torch.dtype, quantize=None, library_fp8=None
         ) -> dict[str, str]:
    """For each distinct (N, K, dtype) of ``weights`` ((weight, per-row scale or None) on a CUDA device) and each M
    range of ``BUCKETS`` (timed at its top, in CUDA graphs over weight copies larger than the L2 cache, as a step
    reads them): the fastest config that is correct (against float32 on the dequantized operands) and ≥ 3 % faster
    than the library — ``torch._scaled_mm`` on the same quantized activations for e4m3 weights, cuBLAS otherwise —
    else the library → {"NxK dtype": what won, per range}. ``quantize(x)`` (→ a quantized activation: ``.q``,
    ``.scale``) and ``library_fp8(xa, w, scale)``: the FP8 path's quantization and library GEMM (``quant.fp8``'s,
    passed in by ``services/worker/startup.py``: the kernels import nothing of ``quant``)."""
    import torch.nn.functional as F

    from services.worker.kernels.small_m import L2_SPAN, _close, _time, fastest, record, verdict

    report: dict[str, str] = {}
    disk = tuning_cache.Decisions.on("gemm", weights[0][0].device) if weights else None
    for w, s in weights:
        n, k = w.shape
        key, name = (n, k, w.dtype), f"{n}x{k} {str(w.dtype).removeprefix('torch.')}"
        if name in report:
            continue
        if key in kernels.gemm_tuned:  # (decided earlier in this process: kept)
            report[name] = kernels.gemm_tuned[key]
            continue
        scaled = w.dtype == FP8
        copies = max(1, min(16, -(-L2_SPAN // (w.numel() * w.element_size()))))
        wc = [w] + [w.clone() for _ in range(copies - 1)]
        deq = w.float() * s.float()[:, None] if scaled else w.float()
        tops = [b for b in BUCKETS if (n < 65536 or b <= LOGITS_MAX_M) and (scaled or b <= PLAIN_MAX_M)]
        picks, said, reused, cached = [], [], 0, disk.get(name, dtype, (GemmConfig,))
        for top in tops:
            if not _fits(top, n, k, w.device):  # (a small GPU: this range's operands and outputs would not fit)
                picks.append((top, None))
                said.append(f"M≤{top}: library (not timed: too little free memory)")
                continue
            x = torch.randn(top, k, dtype=dtype, device=w.device)
            edges = _edges(top)
            if scaled:
                xa = quantize(x)
                want = (xa.q[edges].float() * xa.scale[edges]) @ deq.t()
                lib = lambda i, r=top: library_fp8(xa, wc[i], s)  # noqa: E731
                run = lambda cfg, wi, r=top: matmul(xa.q, wi, dtype, cfg, xa.scale, s)  # noqa: E731
            else:
                want = x[edges].float() @ deq.t()
                lib = lambda i, r=top: F.linear(x[:r], wc[i])  # noqa: E731
                run = lambda cfg, wi, r=top: matmul(x[:r], wi, dtype, cfg)  # noqa: E731
            check = lambda cfg: _close(run(cfg, w)[edges].float(), want)  # noqa: E731
            if tuning_cache.reuse(cached.get(top), check):
                picks.append((top, cached[top][0]))
                said.append(cached[top][1])
                reused += 1
                continue
            base = _time(lambda i, r=top: lib(i, r), copies)
            best, best_t = fastest(CONFIGS if scaled else PLAIN_CONFIGS, base, check,
                                   lambda cfg, r=top: _time(lambda i: run(cfg, wc[i], r), copies))
            picks.append((top, best))
            said.append(verdict(top, best, best_t, base))
        report[name] = record(kernels.gemm_choices, kernels.gemm_tuned, key, picks, said, disk, name, dtype,
                              reused)
    if disk is not None:
        disk.save()
    return report


def _edges(top: int) -> slice | Tensor:
    """The rows of a range's check: all of them up to 2 × ``EDGE_ROWS``, else the first and the last that many."""
    if top <= 2 * EDGE_ROWS:
        return slice(None)
    return torch.cat([torch.arange(EDGE_ROWS), torch.arange(top - EDGE_ROWS, top)])


def _fits(top: int, n: int, k: int, device: torch.device) -> bool:
    """Whether timing a range at ``top`` rows (a graph of 8 calls' outputs, the activations, the checked rows in
    float32) takes at most half the device's free memory."""
    need = 8 * top * n * 2 + top * k * 4 + 2 * 2 * EDGE_ROWS * n * 4
    return need <= torch.cuda.mem_get_info(device)[0] // 2
