"""Linear layers at decode batch sizes (M ≤ ``MAX_M`` rows): y = x W^T (· scale per output row).

At M = 1–16 a linear is a read of its weight: the floor is weight bytes ÷ HBM bandwidth. The
library paths are not built for it: cuBLAS's bf16 GEMV reaches 70–95 % of copy bandwidth on the
H200 (the small shapes worst), and FP8 weights through ``torch._scaled_mm`` pay a per-token
activation quantization and run *slower* than bf16 at M = 1. These kernels stream
the weight once, whatever its element type (bf16/fp16, or e4m3 widened in registers and its per-row
scale applied at the end: weight-only FP8, the activations stay in their dtype). Three ways to multiply:

- ``dot``: the M rows padded to one 16-row tensor-core tile (``tl.dot``), a program per ``block_n``
  output rows;
- ``swap``: the same tile product as W x^T, the weight tile (widened in registers when e4m3) the
  tensor cores' A operand, which Hopper reads from registers (the B operand goes through shared
  memory: the small x rather than the weight);
- ``fma``: CUDA cores, one row of x a program, small ``block_n`` so that many programs keep many
  weight loads in flight; the products are summed elementwise across the K tiles and reduced once
  at the end (a reduction per tile, measured first, ran far below bandwidth).

And a fourth, not Triton: ``cuda_gemv`` (``gemv.cu``, built with nvcc where there is one), whose e4m3
weights are widened by integer instructions; ``tune`` times its configs beside these.

Two ways to run e4m3 weights faster were measured on the H200 and dropped: feeding the FP8 tensor
cores (x quantized per K tile in registers) and widening to fp16 rather than bf16 (one instruction
a pair; x scaled into fp16's range by a first pass over it): both 10–50 % slower than the plain
``dot`` at every 8B shape (docs/decisions/). Any config may split K in ``split`` parts, each program
writing float32 partial sums that a second kernel adds **in a fixed order** (no atomics: greedy outputs must not change from run to run). For a
given config each output row is computed the same way whatever M is, bit for bit. With
``last_adds`` there is no second kernel: each program stores its part, and the one that finds, by an
atomic count per output tile, that it finished the tile last adds the parts in the same fixed order
and resets the count (a launch less per linear: ~2.5 µs each at decode in a CUDA graph). ``tune`` times
every config against the library path for each weight shape of the model at start-up, per range of
M (``BUCKETS``), inside CUDA graphs (as decode runs) over weight copies larger than the L2 cache,
and records a config only where it is correct and ≥ 3 % faster (``kernels.choices``): never slower.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from services.worker import kernels
from services.worker.kernels import BUCKETS, MAX_M, cdiv, cuda_gemv, tuning_cache

Tensor = torch.Tensor


@triton.jit
def _load_x(x_at, x_mask, K, SILU_MUL: tl.constexpr):
    """A tile of x, or with ``SILU_MUL`` silu(gate) · up from the gate_up projection's (M, 2K) output
    (rounded to x's dtype, as SiluAndMul rounds it)."""
    if SILU_MUL:
        gate = tl.load(x_at, mask=x_mask, other=0.0).to(tl.float32)
        up = tl.load(x_at + K, mask=x_mask, other=0.0).to(tl.float32)
        return (gate / (1.0 + tl.exp(-gate)) * up).to(x_at.dtype.element_ty)
    return tl.load(x_at, mask=x_mask, other=0.0)


@triton.jit
def _linear_kernel(x_ptr, w_ptr, s_ptr, out_ptr, y_ptr, cnt_ptr, M, N, K, k_per_split, stride_x, stride_w,
                   stride_out, HAS_SCALE: tl.constexpr, USE_DOT: tl.constexpr, SWAP: tl.constexpr,
                   PARTIAL: tl.constexpr, LAST_ADDS: tl.constexpr, SPLIT: tl.constexpr, SILU_MUL: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n, pid_s, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    k_lo = pid_s * k_per_split
    k_hi = tl.minimum(K, k_lo + k_per_split)
    if SWAP:
        acc_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    elif USE_DOT:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:  # CUDA cores: products summed elementwise across the K tiles, reduced once at the end
        acc3 = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    w_rows = w_ptr + rn[:, None].to(tl.int64) * stride_w
    for k0 in range(k_lo, k_hi, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_rows + rk[None, :], mask=(rn[:, None] < N) & (rk[None, :] < k_hi), other=0.0)
        x = _load_x(x_ptr + rm[:, None] * stride_x + rk[None, :], (rm[:, None] < M) & (rk[None, :] < k_hi),
                    K, SILU_MUL)
        w = w.to(x_ptr.dtype.element_ty)
        if SWAP:  # y^T = W x^T: the weight, widened in registers, is the A operand (no shared-memory trip)
            acc_t += tl.dot(w, tl.trans(x))
        elif USE_DOT:
            acc += tl.dot(x, tl.trans(w))
        else:
            acc3 += w.to(tl.float32)[None, :, :] * x.to(tl.float32)[:, None, :]
    if SWAP:
        acc = tl.trans(acc_t)
    elif not USE_DOT:
        acc = tl.sum(acc3, axis=2)
    out_mask = (rm[:, None] < M) & (rn[None, :] < N)
    if PARTIAL:  # (split, M, N) float32, summed by _sum_kernel — or here, by the tile's last part
        part = out_ptr + rm[:, None] * N + rn[None, :]
        tl.store(part + pid_s * M * N, acc, mask=out_mask)
        if LAST_ADDS:  # the program that finishes a tile last adds its parts, in order, and resets its count
            tl.debug_barrier()  # (every thread's part stored before the count says so: release below)
            count = cnt_ptr + pid_m * tl.num_programs(0) + pid_n
            if tl.atomic_add(count, 1, sem="acq_rel") == SPLIT - 1:
                total = tl.load(part, mask=out_mask, other=0.0, cache_modifier=".cg")
                for j in tl.static_range(1, SPLIT):  # (the parts in order: the same sum every run)
                    total += tl.load(part + j * M * N, mask=out_mask, other=0.0, cache_modifier=".cg")
                if HAS_SCALE:
                    total = total * tl.load(s_ptr + rn, mask=rn < N, other=0.0)[None, :]
                tl.store(y_ptr + rm[:, None] * stride_out + rn[None, :], total.to(y_ptr.dtype.element_ty),
                         mask=out_mask)
                tl.atomic_xchg(count, 0)
    else:
        if HAS_SCALE:
            acc = acc * tl.load(s_ptr + rn, mask=rn < N, other=0.0)[None, :]
        tl.store(out_ptr + rm[:, None] * stride_out + rn[None, :], acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _sum_kernel(p_ptr, s_ptr, y_ptr, M, N, stride_y, SPLIT: tl.constexpr, HAS_SCALE: tl.constexpr,
                BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    acc = tl.load(p_ptr + offs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT):  # (the parts in order: the same sum every run)
        acc += tl.load(p_ptr + s * M * N + offs, mask=mask, other=0.0)
    m, n = offs // N, offs % N
    if HAS_SCALE:
        acc = acc * tl.load(s_ptr + n, mask=mask, other=0.0)
    tl.store(y_ptr + m * stride_y + n, acc.to(y_ptr.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class Config:
    block_n: int
    block_k: int
    warps: int = 4
    stages: int = 3
    split: int = 1  # K in this many parts, added by a second kernel in a fixed order
    m_tile: int = 16  # rows a program: 16 = one tensor-core tile (tl.dot); fewer = CUDA-core FMAs
    swap: bool = False  # (tensor cores) W x^T rather than x W^T: the weight tile is the A operand
    last_adds: bool = False  # (split) the parts added by each tile's last program, not by a second kernel

    def __str__(self) -> str:
        kind = ("swap" if self.swap else "dot") if self.m_tile == 16 else f"fma{self.m_tile}"
        return f"{kind}_{self.block_n}x{self.block_k}w{self.warps}s{self.stages}k{self.split}{'r' * self.last_adds}"


# (each won a shape in a recorded start-up, benchmarks/results/*; docs/decisions/0007-tuner-configs-that-never-won.md)
CONFIGS = (Config(32, 256), Config(64, 128, stages=4), Config(32, 256, split=2), Config(32, 128, stages=4, split=4),
           Config(4, 1024, m_tile=1), Config(4, 512, stages=4, m_tile=1), Config(8, 256, stages=4, m_tile=1),
           Config(64, 128, stages=4, split=2, swap=True),
           Config(32, 256, split=2, last_adds=True), Config(32, 128, stages=4, split=4, last_adds=True),
           Config(64, 128, stages=4, split=2, swap=True, last_adds=True))
_counts: dict[torch.device, Tensor] = {}  # per device: a count per output tile of the running call (LAST_ADDS)


def linear(x: Tensor, w: Tensor, scale: Tensor | None = None, cfg: Config | cuda_gemv.CudaConfig = CONFIGS[0],
           silu_mul: bool = False, act_out: bool = False) -> Tensor:
    """x (M ≤ MAX_M, K) @ w (N, K)^T, times ``scale`` (N,) per output row if given → (M, N) in x's dtype.
    ``silu_mul``: x is (M, 2K), [gate | up], and the product is taken with silu(gate) · up (the
    activation fused into the weight's read: one kernel less a layer). ``act_out``: w is [gate | up] and
    the result silu(gate) · up (M, N / 2) — made as the CUDA kernel stores its sums; the activation
    kernel after the Triton ones."""
    if isinstance(cfg, cuda_gemv.CudaConfig):  # (the CUDA kernel: gemv.cu)
        return cuda_gemv.linear(x, w, scale, cfg, silu_mul, act_out)
    if act_out:
        from services.worker.kernels.ops import current_ops

        return current_ops().silu_and_mul(linear(x, w, scale, cfg, silu_mul))
    m, k = x.shape[0], w.shape[1]
    n = w.shape[0]
    assert m <= MAX_M and x.shape[1] == (2 * k if silu_mul else k) and w.stride(1) == 1
    if x.stride(1) != 1:
        x = x.contiguous()
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    k_per_split = cdiv(cdiv(k, cfg.split), cfg.block_k) * cfg.block_k
    split = cdiv(k, k_per_split)
    out = y if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    s = scale if scale is not None else w
    grid = (cdiv(n, cfg.block_n), split, cdiv(m, cfg.m_tile))
    last_adds = cfg.last_adds and split > 1
    counts = _tile_counts(x.device, grid[0] * grid[2]) if last_adds else y
    _linear_kernel[grid](x, w, s, out, y, counts, m, n, k, k_per_split, x.stride(0), w.stride(0), y.stride(0),
                         HAS_SCALE=scale is not None, USE_DOT=cfg.m_tile == 16, SWAP=cfg.swap,
                         PARTIAL=split > 1, LAST_ADDS=last_adds, SPLIT=split, SILU_MUL=silu_mul,
                         BLOCK_M=cfg.m_tile, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                         num_warps=cfg.warps, num_stages=cfg.stages)
    if split > 1 and not last_adds:
        block = 1024
        _sum_kernel[(cdiv(m * n, block),)](out, s, y, m, n, y.stride(0), SPLIT=split,
                                                  HAS_SCALE=scale is not None, BLOCK=block, num_warps=4)
    return y


def _tile_counts(device: torch.device, tiles: int) -> Tensor:
    """Zeroed int32 counts for ``tiles`` output tiles (each call leaves them zero again). Made at the
    first call on a device (an eager one: tuning and the warm-up before graph capture come first)
    with room for the largest weight (the lm_head's 128,256 rows in 32-row tiles: 4,008)."""
    counts = _counts.get(device)
    if counts is None or counts.numel() < tiles:
        counts = _counts[device] = torch.zeros(max(tiles, 1 << 15), dtype=torch.int32, device=device)
    return counts


# --- which shapes use it: measured on the device at start-up -------------------------------------------

L2_SPAN = 256 << 20  # bytes of weight copies a timing cycles through (the H200's L2 is 50 MB)


def _time(fn_for, copies: int, reps: int = 3) -> float:
    """Seconds per call of ``fn_for(i)`` (i cycling over ``copies`` weight copies), replayed from
    a CUDA graph as a decode step is (launch overhead out of the figure)."""
    for i in range(copies):
        fn_for(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    calls = max(copies, 8)
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn_for(i % copies)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / (reps * calls)


def tune(weights: list[tuple[Tensor, Tensor | None]], library, dtype: torch.dtype, act=None,
         act_out=None) -> dict[str, str]:
    """For each distinct (N, K, dtype) of ``weights`` ((weight, scale or None) pairs on a CUDA
    device) and each M range of ``BUCKETS`` (timed at its largest M): the fastest config that is
    correct (against float32 on the dequantized weight) and ≥ 3 % faster than the library path
    (``library(x, w, scale)``), else the library. With ``act`` (SiluAndMul: (M, 2K) → (M, K)) the
    weights are read after it: the fused kernel (``silu_mul``) against ``act`` then the library. With
    ``act_out`` (SiluAndMul) the weights are [gate | up] and their product goes through it: the kernel that
    makes it as it stores (``act_out``) against the library then ``act_out``.
    → {"NxK dtype": what won, per M range}."""
    report: dict[str, str] = {}
    disk = tuning_cache.Decisions.on("small_m", weights[0][0].device) if weights else None
    for w, s in weights:
        n, k = w.shape
        key = (n, k, w.dtype) + (("silu_mul",) if act is not None else ()) + (("act_out",) if act_out else ())
        name = (f"{n}x{k} {str(w.dtype).removeprefix('torch.')}" + (" after silu_mul" if act is not None else "")
                + (" then silu_mul" if act_out is not None else ""))
        if name in report:
            continue
        if key in kernels.tuned:  # (decided earlier in this process: kept)
            report[name] = kernels.tuned[key]
            continue
        nbytes = w.numel() * w.element_size()
        copies = max(1, min(16, -(-L2_SPAN // nbytes)))
        ws = [w] + [w.clone() for _ in range(copies - 1)]
        deq = w.float() if s is None else w.float() * s.float()[:, None]
        lib = library if act is None else (lambda x, w, s: library(act(x), w, s))
        if act_out is not None:
            lib = lambda x, w, s, plain=lib: act_out(plain(x, w, s))  # noqa: E731
        picks, said, reused, cached = [], [], 0, disk.get(name, dtype, (Config, cuda_gemv.CudaConfig))
        for top in BUCKETS:
            x = torch.randn(top, 2 * k if act is not None else k, dtype=dtype, device=w.device) / k**0.5
            want = (x if act is None else act(x)).float() @ deq.t()
            if act_out is not None:
                want = torch.nn.functional.silu(want[:, : n // 2]) * want[:, n // 2:]

            def check(cfg) -> bool:
                got = linear(x, w, s, cfg, act is not None, act_out is not None)
                if not _close(got.float(), want):
                    return False
                # the same bits every time where parts are added across programs (the tile's last
                # program, its count and the parts' visibility; the CUDA kernel's warps)
                repeats = not isinstance(cfg, Config) or cfg.last_adds
                again = (linear(x, w, s, cfg, act is not None, act_out is not None) for _ in range(16))
                return not repeats or all(torch.equal(y, got) for y in again)

            if tuning_cache.reuse(cached.get(top), check):
                picks.append((top, cached[top][0]))
                said.append(cached[top][1])
                reused += 1
                continue
            base = _time(lambda i: lib(x, ws[i], s), copies)
            best, best_t = fastest(CONFIGS + cuda_gemv.configs_for(w, x), base, check, lambda cfg: _time(
                lambda i: linear(x, ws[i], s, cfg, act is not None, act_out is not None), copies))
            picks.append((top, best))
            said.append(verdict(top, best, best_t, base))
        report[name] = record(kernels.choices, kernels.tuned, key, picks, said, disk, name, dtype, reused)
    if disk is not None:
        disk.save()
    return report


def fastest(configs, base: float, check, timed) -> tuple[object | None, float]:
    """The fastest of ``configs`` that passes ``check(cfg)`` and times (``timed(cfg)``, seconds) ≥ 3 % under the
    library's ``base`` → (it, its time); (None, base / 1.03) when none does. A config that raises (one the compiler
    rejects on this device) is skipped."""
    best, best_t = None, base / 1.03
    for cfg in configs:
        try:
            if not check(cfg):
                continue
            t = timed(cfg)
        except Exception:
            continue
        if t < best_t:
            best, best_t = cfg, t
    return best, best_t


def record(choices: dict, tuned: dict, key: tuple, picks: list, said: list[str], disk, name: str,
           dtype: torch.dtype, reused: int) -> str:
    """A shape's decisions kept for the process: its (top M, config or None) ranges where any config won, and the
    report line (also when none did: decided once) → the report line. They go to ``disk`` (``tuning_cache``)
    unless all were ``reused`` from it (then the line says so)."""
    if any(cfg is not None for _, cfg in picks):
        choices[key] = tuple(picks)
    if reused < len(picks):
        disk.put(name, dtype, picks, said)
    tuned[key] = "; ".join(said) + (" (cached)" if picks and reused == len(picks) else "")
    return tuned[key]


def verdict(top: int, best: object | None, best_t: float, base: float) -> str:
    """What ``fastest`` found for the range of M up to ``top``, as the start-up report says it."""
    return f"M≤{top}: " + (f"{best} {best_t * 1e6:.1f} us vs library {base * 1e6:.1f}" if best
                           else f"library {base * 1e6:.1f} us")


def _close(got: Tensor, want: Tensor) -> bool:
    return bool(torch.allclose(got, want, rtol=2e-2, atol=1e-2 * float(want.abs().max()) + 1e-6))
