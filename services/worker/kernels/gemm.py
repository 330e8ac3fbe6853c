"""GEMMs beyond the small-M kernels' rows (decode batches, mixed steps), in Triton, each chosen per weight shape and
range of M at start-up only where it measured correct and ≥ 3 % faster than the library on the same operands —
never slower:

- FP8: y = (xq · sx)(wq · sw)^T on FP8 tensor cores, the per-token scales sx (M, 1) and per-channel scales sw (N,)
  applied in the epilogue, against ``torch._scaled_mm`` (cuBLASLt's row-wise scaled kernels);
- bf16/fp16: y = x w^T against cuBLAS (``F.linear``), up to ``PLAIN_MAX_M`` rows (decode batches: a read of the
  weight at ~79 % of HBM bandwidth by cuBLAS at M = 64 — docs/perf.md; above, the GEMMs are compute-bound and
  cuBLAS's) — and there cuBLASLt's other algorithms too (``cublaslt.LtConfig``: the Triton configs did not beat
  cuBLAS at these shapes on the H100 or the H200, docs/perf.md 2026-12-05 twenty-seventh session); with those on,
  prompt chunks up to ``LT_MAX_M`` rows get a choice among cuBLASLt's algorithms as well (W2's ~27 s of prompt
  GEMMs run at ~87 % of the measured peak).

Why: in W2 with FP8 weights the decode steps gained nothing over bf16 (~90-row graphs 9.8 vs 10.3 ms, ~600-row
piecewise steps 42.0 vs 40.9 ms; docs/perf.md 2026-12-05) where half the weight bytes and twice the tensor-core
rate should save ~1.8 and ~6 ms: the library's kernel at those M is the suspect (``small_m_bench --library-only``
times it). A program computes a ``block_m`` × ``block_n`` tile over the whole K, or with ``split`` over a part of
it, writing float32 sums that a second kernel adds in a fixed order (the same bits every run; no atomics);
programs are ordered in groups of ``group_m`` row tiles so that neighbours share a weight tile (read from HBM
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
from services.worker.kernels import cdiv, cublaslt, tuning_cache
from services.worker.kernels.cublaslt import LtConfig
from services.worker.quant.fp8 import FP8, fast_accum

Tensor = torch.Tensor
# M ranges with a choice of their own, each timed at its top (above the last: the library)
BUCKETS = (32, 64, 128, 256, 512, 1024, 2048, 4096, 16384)
PLAIN_MAX_M = 1024  # (bf16/fp16 weights: cuBLAS above, or with cuBLASLt's candidates on, theirs up to LT_MAX_M)
LT_MAX_M = 16384  # (prompt chunks: cuBLASLt's other algorithms only — our configs are decode-sized tiles)
LOGITS_MAX_M = 1024  # (a vocabulary-wide weight multiplies a step's sampled rows only: its ranges stop here)


@triton.jit(do_not_specialize=["M"])  # (one compiled kernel for every M: start-up compiles what a step will run)
def _gemm_kernel(a_ptr, b_ptr, sa_ptr, sb_ptr, c_ptr, M, N, K, k_per_split, stride_a, stride_b, stride_c,
                 SCALED: tl.constexpr, EVEN_K: tl.constexpr, PRECISE: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PARTIAL: tl.constexpr = False):
    pid, pid_s = tl.program_id(0), tl.program_id(1)
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * tiles_n
    first_m = (pid // in_group) * GROUP_M
    group_m = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_m  # (row tiles fastest: neighbours share the weight tile)
    pid_n = (pid % in_group) // group_m
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if PARTIAL:  # (this program's part of K: whole BLOCK_K tiles)
        k_lo = pid_s * k_per_split
        k_hi = tl.minimum(K, k_lo + k_per_split)
    else:  # (the whole of K: the kernel as it was before parts, measured in W1-W6)
        k_lo = 0
        k_hi = K
    rk = tl.arange(0, BLOCK_K)
    a_at = a_ptr + rm[:, None].to(tl.int64) * stride_a + k_lo + rk[None, :]
    b_at = b_ptr + rn[:, None].to(tl.int64) * stride_b + k_lo + rk[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
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
    if PARTIAL:  # (float32 sums of this part of K, unscaled: _add_parts adds the parts in order)
        at = c_ptr + pid_s.to(tl.int64) * M * N + rm[:, None].to(tl.int64) * N + rn[None, :]
        tl.store(at, acc, mask=(rm[:, None] < M) & (rn[None, :] < N))
    else:
        if SCALED:
            acc = acc * tl.load(sa_ptr + rm, mask=rm < M, other=0.0)[:, None]
            acc = acc * tl.load(sb_ptr + rn, mask=rn < N, other=0.0)[None, :]
        tl.store(c_ptr + rm[:, None].to(tl.int64) * stride_c + rn[None, :], acc.to(c_ptr.dtype.element_ty),
                 mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit(do_not_specialize=["M"])
def _add_parts(part_ptr, sa_ptr, sb_ptr, c_ptr, M, N, stride_c, PARTS: tl.constexpr, SCALED: tl.constexpr,
               BLOCK: tl.constexpr):
    """c = the sum of ``PARTS`` float32 (M, N) partial products, part 0 first (a fixed order: the same bits every
    run), times the row and column scales when ``SCALED``."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = i < M * N
    acc = tl.load(part_ptr + i, mask=ok, other=0.0)
    for p in tl.static_range(1, PARTS):
        acc += tl.load(part_ptr + p * M * N + i, mask=ok, other=0.0)
    r, c = i // N, i % N
    if SCALED:
        acc = acc * tl.load(sa_ptr + r, mask=ok, other=0.0) * tl.load(sb_ptr + c, mask=ok, other=0.0)
    tl.store(c_ptr + r * stride_c + c, acc.to(c_ptr.dtype.element_ty), mask=ok)


@dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    warps: int = 4
    stages: int = 4
    group_m: int = 8
    split: int = 1  # (K in this many parts, each a program's, added by a second kernel in a fixed order)

    def __str__(self) -> str:
        name = f"gemm_{self.block_m}x{self.block_n}x{self.block_k}w{self.warps}s{self.stages}g{self.group_m}"
        return name + (f"k{self.split}" if self.split > 1 else "")


# 64-row tiles (one warpgroup's wgmma) for decode batches, where the weight read dominates — narrow ones for the
# 4,096-row weights, so that enough programs read; 128-row tiles with wide N for mixed steps, where the tensor cores
# do; shared memory a stage is (block_m + block_n) × block_k × the element size
CONFIGS = (GemmConfig(64, 64, 128), GemmConfig(64, 128, 128), GemmConfig(64, 64, 256, stages=3),
           GemmConfig(64, 64, 128, stages=6),  # (deeper: more weight bytes in flight an SM, for the memory-bound rows)
           GemmConfig(64, 32, 256),  # (N = 4,096 at ≤ 64 rows: 128 programs, not 64 — every SM streaming weight)
           GemmConfig(64, 128, 256, warps=8, stages=3), GemmConfig(128, 64, 128), GemmConfig(128, 128, 128, warps=8),
           GemmConfig(128, 256, 128, warps=8, stages=3), GemmConfig(128, 128, 64, warps=8, stages=5),
           # K in parts (decode batches only, SPLIT_MAX_M): 2-4× the programs for the 4,096- and 6,144-row weights
           # and half the K loop of the 14,336-wide one — more of the weight in flight at once
           GemmConfig(64, 64, 128, stages=6, split=2), GemmConfig(64, 128, 128, split=4))
PLAIN_CONFIGS = (GemmConfig(64, 64, 64), GemmConfig(64, 128, 64), GemmConfig(64, 32, 128),
                 GemmConfig(64, 64, 128, stages=3), GemmConfig(64, 64, 64, stages=6), GemmConfig(64, 128, 64, stages=5),
                 GemmConfig(128, 64, 64), GemmConfig(128, 128, 64, warps=8, stages=3),
                 GemmConfig(64, 64, 64, stages=6, split=2), GemmConfig(64, 128, 64, stages=5, split=4))
SPLIT_MAX_M = 128  # (configs with K in parts are timed for the ranges up to here, not for the vocabulary-wide
# weight: above, or there, the tiles fill the GPU; their float32 parts take parts × M × N × 4 bytes a call)
ADD_BLOCK = 1024  # (elements a program of _add_parts)
EDGE_ROWS = 256  # (above 512 rows the check compares the first and last this many with float32: the tiles repeat)


def matmul(x: Tensor, w: Tensor, out_dtype: torch.dtype, cfg: GemmConfig | LtConfig = CONFIGS[0],
           xs: Tensor | None = None, ws: Tensor | None = None) -> Tensor:
    """x (M, K) @ w (N, K)^T → (M, N): bf16/fp16 operands, or e4m3 ones with xs (M, 1) and ws (N,) float32 scales
    (then (x·xs)(w·ws)^T). An ``LtConfig``: cuBLASLt's algorithm (bf16/fp16), the library's where it refuses."""
    if isinstance(cfg, LtConfig):
        y = cublaslt.matmul(x, w, cfg)
        return y if y is not None else torch.nn.functional.linear(x, w)
    m, k = x.shape
    n = w.shape[0]
    assert w.shape[1] == k and w.stride(1) == 1 and (xs is None) == (ws is None)
    if x.stride(1) != 1:
        x = x.contiguous()
    y = torch.empty((m, n), dtype=out_dtype, device=x.device)
    if m:
        scaled = xs is not None
        sa, sb = (xs, ws) if scaled else (x, w)
        per = cdiv(cdiv(k, cfg.split), cfg.block_k) * cfg.block_k  # (K a part: whole tiles)
        parts = cdiv(k, per)
        out = y if parts == 1 else torch.empty((parts, m, n), dtype=torch.float32, device=x.device)
        grid = (cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n), parts)
        _gemm_kernel[grid](x, w, sa, sb, out, m, n, k, per, x.stride(0), w.stride(0), y.stride(0), SCALED=scaled,
                           EVEN_K=k % cfg.block_k == 0, PRECISE=not fast_accum(), BLOCK_M=cfg.block_m,
                           BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, PARTIAL=parts > 1,
                           num_warps=cfg.warps, num_stages=cfg.stages)
        if parts > 1:
            _add_parts[(cdiv(m * n, ADD_BLOCK),)](out, sa, sb, y, m, n, y.stride(0), PARTS=parts,
                                                         SCALED=scaled, BLOCK=ADD_BLOCK, num_warps=4)
    return y


def tune(weights: list[tuple[Tensor, Tensor | None]], dtype: torch.dtype) -> dict[str, str]:
    """For each distinct (N, K, dtype) of ``weights`` ((weight, per-row scale or None) on a CUDA device) and each M
    range of ``BUCKETS`` (timed at its top, in CUDA graphs over weight copies larger than the L2 cache, as a step
    reads them): the fastest config that is correct (against float32 on the dequantized operands) and ≥ 3 % faster
    than the library — ``torch._scaled_mm`` on the same quantized activations for e4m3 weights, cuBLAS otherwise —
    else the library → {"NxK dtype": what won, per range}."""
    import torch.nn.functional as F

    from services.worker.kernels.small_m import L2_SPAN, _close, _time, fastest, record, verdict
    from services.worker.quant import fp8

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
        plain_max = LT_MAX_M if n < 65536 and cublaslt.enabled() else PLAIN_MAX_M
        tops = [b for b in BUCKETS if (n < 65536 or b <= LOGITS_MAX_M) and (scaled or b <= plain_max)]
        picks, said, reused, cached = [], [], 0, disk.get(name, dtype, (GemmConfig, LtConfig))
        for low, top in zip((1, *(t + 1 for t in tops)), tops):
            if not _fits(top, n, k, w.device):  # (a small GPU: this range's operands and outputs would not fit)
                picks.append((top, None))
                said.append(f"M≤{top}: library (not timed: too little free memory)")
                continue
            x = torch.randn(top, k, dtype=dtype, device=w.device)
            edges = _edges(top)
            if scaled:
                xa = fp8.quantize_activation(x)
                want = (xa.q[edges].float() * xa.scale[edges]) @ deq.t()
                lib = lambda i, r=top: fp8.library_gemm(xa, wc[i], s)  # noqa: E731
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
            # (a prompt range is timed at its middle too: tiles and waves change with M; a choice must not lose there)
            points = (top,) if scaled or top <= PLAIN_MAX_M else (top, (low + top) // 2)
            bases = [_time(lambda i, r=r: lib(i, r), copies) for r in points]
            base = sum(bases)
            split_ok = top <= SPLIT_MAX_M and n < 65536  # (not the vocabulary-wide weight: see SPLIT_MAX_M)
            ours = () if not scaled and top > PLAIN_MAX_M else CONFIGS if scaled else PLAIN_CONFIGS
            cands = [c for c in ours if c.split == 1 or split_ok]
            cands += [] if scaled else cublaslt.candidates(top, n, k, dtype, lowest_m=low)
            best, best_t = fastest(cands, base, check, lambda cfg: _timed(run, cfg, wc, copies, points, bases))
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


def _timed(run, cfg, wc: list[Tensor], copies: int, points: tuple[int, ...], bases: list[float]) -> float:
    """``cfg``'s seconds summed over the rows ``points`` (``run(cfg, weight, rows)``); infinite where it is slower than
    the library (``bases``) at any point but the first (that one ``fastest`` weighs against the sum)."""
    from services.worker.kernels.small_m import _time

    times = [_time(lambda i, r=r: run(cfg, wc[i], r), copies) for r in points]
    return sum(times) if all(t <= b for t, b in zip(times[1:], bases[1:])) else float("inf")


def tune_model(model: torch.nn.Module, dtype: torch.dtype, fp8_only: bool = False) -> dict[str, str]:
    """``tune`` over the model's linear layers (``quantized()``: weight, per-row scale or None); with ``fp8_only``
    its e4m3 ones only."""
    weights = [mod.quantized() for mod in model.modules() if hasattr(mod, "quantized")]
    with torch.inference_mode():
        return tune([(w, s) for w, s in weights
                     if w.dim() == 2 and (w.dtype == FP8 and s is not None or not fp8_only and w.dtype == dtype)],
                    dtype)
