"""Decode attention over the paged pool in Triton (split-KV "flash decoding"), for FP8 pools.

FlashInfer's FP8-KV decode kernels read the pool well below bandwidth on the H200 (batch 64 × 1k:
0.20–0.23 ms a layer against bf16's 0.14–0.18, for half the bytes), so an FP8 pool
made decode-heavy runs slower, not faster. This kernel reads each request's K/V rows through its
``req_to_token`` row (page size 1: one token's K of one KV head is ``head_dim`` contiguous
elements), widens them in registers, and attends the GQA group's query heads to them at once (the
group padded to a tensor-core tile).

One launch: a grid of (request, KV head, split) programs, each over one contiguous part of the
request's context → a partial output and log-sum-exp per query head; the program that finishes a
(request, KV head) last (a count per pair, reset by it) merges its parts by their log-sum-exp, times
the pool's ``v_scale`` (a second kernel did that before: 1.7 µs a layer at batch 1 on the H200,
H200). Programs past a short context's last part store nothing; a context in one part is
stored by its program as it is. Nothing is
planned on the host: the programs read each request's table row and prefix length from the device
(the graph buffers or the eager batch), and the split count depends only on the batch size, so a
CUDA graph captured at a batch size replays for any context lengths.

Works for any pool dtype: bf16/fp16 pools' decode-only steps take it up to 255 rows by default
(``decode_rules.triton_rows_up_to``); the tests run float32 in Triton's interpreter."""

from __future__ import annotations

import torch

from services.worker.attention.decode_rules import (  # noqa: F401 (the launch rules: part of this module's API)
    AUTO_TRITON_ROWS, BLOCK_N, FP8_NARROW_PAIRS, FP8_TWO_SPLIT_PAIRS, FP8_WIDE_BLOCK, MAX_PAIRS, MAX_SPLITS,
    SPLIT_COUNTS, TARGET_PROGRAMS, knobs, launch_config, min_part_tokens, num_splits, pipelined, plain_stages,
    triton_rows_up_to, WIDEN_MODES, _interpreting, widen_mode)
from services.worker.kernels.triton_pdl import launch_pdl
from services.worker.numerics import FP8_MAX, pow2_at_least

try:
    import triton
    import triton.language as tl
except ImportError:  # (the CPU install: nothing here is used without CUDA)
    triton = None


def warm_up(q_dtype: torch.dtype, pool_dtype: torch.dtype, heads: tuple[int, int, int], device: torch.device,
            f16: bool = False) -> int:
    """Compile, before serving, every variant the eager steps launch (``launch_config``s × table rows with
    or without ``starts`` and the log-sum-exp; a graph's flat variant compiles at its capture):
    Triton compiles a variant on its first launch, ~0.5 s each — inside a step, that stalled W7's
    steps to 0.6–0.9 s on the H200. ``heads`` = (q heads, KV heads, head_dim) → variants launched."""
    hq, hkv, d = heads
    slots, ctx = 64, 48
    k = torch.zeros((slots, hkv, d), dtype=pool_dtype, device=device)
    table = torch.arange(ctx, dtype=torch.int32, device=device).repeat(2, 1)  # (a 2-row table, as the runner's)
    rows = torch.zeros(1, dtype=torch.int64, device=device)
    last = torch.full((1,), ctx - 1, dtype=torch.int64, device=device)
    q = torch.zeros((1, hq, d), dtype=q_dtype, device=device)
    new = (q[:, :hkv], q[:, :hkv], torch.zeros((ctx, d), device=device), last, last, *(
        (torch.ones(hkv, device=device),) * 2 if pool_dtype.itemsize == 1 else (None, None)))
    fp8 = f16 and pool_dtype == torch.float8_e4m3fn
    configs = {launch_config(b, hkv, fp8) for b in range(1, MAX_PAIRS // hkv + 1)} | {
        launch_config(1, hkv, fp8, s) for s in SPLIT_COUNTS}
    n = 0
    for cfg in sorted(configs):
        for starts, lse, rope in ((None, False, False), (None, True, False), (last // 2, True, False),
                                  (None, False, True)):
            if rope and not rope_enabled():
                continue
            decode(q, k, k, table, rows, last, 1.0, splits=cfg.splits, return_lse=lse, starts=starts, f16=f16,
                   new=new if rope else None, block=cfg.block, num_warps=cfg.warps, num_stages=cfg.stages,
                   pipe=cfg.pipe)
            n += 1
    return n


_rope = {"on": False}


def rope_enabled() -> bool:
    """Whether pure-decode plans hand the rope and the K/V write to ``decode`` (``new``): set at start-up by
    ``decode_rope.enable_rope`` (unless ``BANYAN_ROPE_IN_DECODE=0``, where ``check_rope`` agrees on the device)."""
    return _rope["on"]


def set_rope(on: bool) -> None:
    _rope["on"] = on


if triton is not None:
    @triton.jit
    def _widen_e4m3(x, WIDEN: tl.constexpr):
        """e4m3 values → fp16 holding value × 2^-8, exactly: the byte sign-extended to 16 bits, shifted left by 7
        (exponent and mantissa land in fp16's, 4 exponent bits under a zero top bit: the bias 15 against 7), and
        the stray copy of the sign at bit 14 masked off. The caller multiplies 2^8 back into its scales."""
        if WIDEN == 2:  # (prmt's sign-replicating selectors: bytes 0, 1 → halves of one register, 2, 3 → another)
            return tl.inline_asm_elementwise(
                "{\n.reg .b32 lo, hi;\nprmt.b32 lo, $2, 0, 0x9180;\nprmt.b32 hi, $2, 0, 0xB3A2;\n"
                "shl.b32 lo, lo, 7;\nshl.b32 hi, hi, 7;\nand.b32 $0, lo, 0xBF80BF80;\nand.b32 $1, hi, 0xBF80BF80;\n}",
                "=r,=r,r", [x.to(tl.uint8, bitcast=True)], dtype=tl.float16, is_pure=True, pack=4)
        wide = (x.to(tl.int8, bitcast=True).to(tl.int32) << 7) & 0xBF80
        return wide.to(tl.int16).to(tl.float16, bitcast=True)

    @triton.jit
    def _prefetch_l1(ptrs, mask):
        """The lines at ``ptrs`` (where ``mask``) into L1 (and L2): a hint, no register waits on it."""
        tl.inline_asm_elementwise(
            "{\n.reg .pred p;\nsetp.ne.s32 p, $2, 0;\n@p prefetch.global.L1 [$1];\nmov.u32 $0, 0;\n}",
            "=r,l,r", [ptrs, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def _partial_kernel(Q, K, V, Table, Rows, Prefix, Start, Opart, Lpart, Out, Lse, Count,
                        Knew, Vnew, CosSin, Pos, Slots, KInv, VInv, stride_nt, stride_nh, stride_vt, stride_vh,
                        stride_cs, stride_qt, stride_qh, stride_ks, stride_kh, stride_tab,
                        stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
                        stride_out_t, stride_out_h, stride_lse_b, qk_scale, v_scale,
                        G: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                        BLOCK: tl.constexpr, SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, HAS_START: tl.constexpr,
                        F16: tl.constexpr, WRITE_LSE: tl.constexpr, PDL: tl.constexpr, ROPE: tl.constexpr,
                        QUANT: tl.constexpr, FMAX: tl.constexpr, WIDEN: tl.constexpr, MIN_PER: tl.constexpr,
                        BLOCK_G: tl.constexpr, WARM: tl.constexpr,
                        PIPE: tl.constexpr = False):
        if PDL:  # (launched overlapping the kernel before: nothing read until it has ended; the next may start)
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        b, h, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        row = tl.load(Rows + b).to(tl.int64)
        n = tl.load(Prefix + b).to(tl.int32) + 1  # the context: the prefix and the token being decoded
        first = tl.load(Start + b).to(tl.int32) if HAS_START else 0  # (a cascade step's own level: from skip)
        offs_g = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        offs_n = tl.arange(0, BLOCK)
        gmask, dmask = offs_g < G, offs_d < D
        heads = h * G + offs_g
        # loads that need no loaded value before the first use of one (a warp issues in order)
        q = tl.load(Q + b * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=gmask[:, None] & dmask[None, :], other=0.0)
        if ROPE:  # (q's other half, the new token's k and v, its position and slot: the rope's inputs)
            low = offs_d < D // 2
            other = tl.where(low, offs_d + D // 2, offs_d - D // 2)  # (D a power of two: BLOCK_D == D)
            pos = tl.load(Pos + b).to(tl.int64)
            q_half = tl.load(Q + b * stride_qt + heads[:, None] * stride_qh + other[None, :], mask=gmask[:, None],
                             other=0.0)
            k_at, v_at = Knew + b * stride_nt + h * stride_nh, Vnew + b * stride_vt + h * stride_vh
            k_raw, k_half, v_new = tl.load(k_at + offs_d), tl.load(k_at + other), tl.load(v_at + offs_d)
            dst = tl.load(Slots + b).to(tl.int64) * stride_ks + h * stride_kh + offs_d
            if QUANT:
                k_inv, v_inv = tl.load(KInv + h), tl.load(VInv + h)
        per = tl.cdiv(tl.cdiv(n - first, SPLITS), BLOCK) * BLOCK
        if MIN_PER:  # (parts of at least MIN_PER tokens: a short context leaves its later programs empty)
            per = tl.maximum(per, MIN_PER)
        parts = tl.cdiv(n - first, per)  # the parts with tokens (the later programs of a short context have none)
        lo = first + s * per
        hi = tl.minimum(lo + per, n)
        if WARM:  # (the first block's slots into L1 beside the rope's loads: the loop reads them after its barrier)
            _prefetch_l1(Table + row * stride_tab + lo + offs_n, lo + offs_n < hi)
        if ROPE:  # q and the new token's k not yet rotated: rotate-half at its position, as ``rope_store``
            cs = CosSin + pos * stride_cs + offs_d % (D // 2)
            cos, sin = tl.load(cs), tl.load(cs + D // 2)
            q_o = q_half.to(tl.float32) * sin[None, :]
            q_c = q.to(tl.float32) * cos[None, :]
            q = tl.where(low[None, :], q_c - q_o, q_c + q_o).to(Q.dtype.element_ty)
            # the program whose part holds the new token writes its K (rotated) and V to the pool, then reads
            # them back in its loop (a barrier: every thread's write seen by the block)
            at_new = tl.full([BLOCK_D], 0, tl.int32) + n - 1  # (the new token's position, per lane: a mask)
            writer = dmask & (at_new >= lo) & (at_new < hi)
            k_c = k_raw.to(tl.float32) * cos
            k_o = k_half.to(tl.float32) * sin
            k_new = tl.where(low, k_c - k_o, k_c + k_o).to(Q.dtype.element_ty)
            if QUANT:
                k_q = tl.minimum(tl.maximum(k_new.to(tl.float32) * k_inv, -FMAX), FMAX)
                v_q = tl.minimum(tl.maximum(v_new.to(tl.float32) * v_inv, -FMAX), FMAX)
            else:
                k_q, v_q = k_new, v_new
            tl.store(K + dst, k_q.to(K.dtype.element_ty), mask=writer)
            tl.store(V + dst, v_q.to(V.dtype.element_ty), mask=writer)
            tl.debug_barrier()
        if F16:  # (the products in fp16: e4m3 widens to it in one instruction a pair)
            q = q.to(tl.float16)
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        if PIPE:  # (slots a block ahead, carried: K/V addresses from no load of their own iteration — Triton's
            # pipeliner then keeps stages - 1 K/V buffers in flight, not one it waits for at every iteration's top)
            at = lo + offs_n
            slot = tl.load(Table + row * stride_tab + at, mask=at < hi, other=0).to(tl.int64)
        for start in range(lo, hi, BLOCK):
            idx = start + offs_n
            nmask = idx < hi
            kv_mask = nmask[:, None] & dmask[None, :]
            if PIPE:
                kv_off = slot[:, None] * stride_ks + h * stride_kh + offs_d[None, :]
                k = tl.load(K + kv_off, mask=kv_mask, other=0.0)
                v = tl.load(V + kv_off, mask=kv_mask, other=0.0)
                at = idx + BLOCK
                slot = tl.load(Table + row * stride_tab + at, mask=at < hi, other=0).to(tl.int64)
            else:
                slot = tl.load(Table + row * stride_tab + idx, mask=nmask, other=0).to(tl.int64)
                kv_off = slot[:, None] * stride_ks + h * stride_kh + offs_d[None, :]
                k = tl.load(K + kv_off, mask=kv_mask, other=0.0)
            if WIDEN:
                k = _widen_e4m3(k, WIDEN)
            else:
                k = k.to(q.dtype)
            qk = tl.dot(q, tl.trans(k)) * qk_scale  # (BLOCK_H, BLOCK) float32, log2 units
            qk = tl.where(nmask[None, :], qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            if not PIPE:
                v = tl.load(V + kv_off, mask=kv_mask, other=0.0)
            if WIDEN:
                v = _widen_e4m3(v, WIDEN)
            else:
                v = v.to(q.dtype)
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v)
            m_i = m_new
        full = l_i > 0
        out = acc / tl.where(full, l_i, 1.0)[:, None]
        lse = tl.where(full, m_i + tl.log2(tl.where(full, l_i, 1.0)), float("-inf"))  # log2 units
        hd_mask = gmask[:, None] & dmask[None, :]
        if SPLITS == 1:  # (one part: it is the result — the merge below would give these very bits)
            tl.store(Out + b * stride_out_t + heads[:, None] * stride_out_h + offs_d[None, :],
                     (out * v_scale).to(Out.dtype.element_ty), mask=hd_mask)
            if WRITE_LSE:
                tl.store(Lse + b * stride_lse_b + heads, lse, mask=gmask)
            return
        if parts <= 1:  # (a context in one part: program 0 stores the result, as with one split; the rest none)
            if s == 0:
                tl.store(Out + b * stride_out_t + heads[:, None] * stride_out_h + offs_d[None, :],
                         (out * v_scale).to(Out.dtype.element_ty), mask=hd_mask)
                if WRITE_LSE:
                    tl.store(Lse + b * stride_lse_b + heads, lse, mask=gmask)
        elif s < parts:
            o_at = Opart + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
            tl.store(o_at + s * stride_os, out, mask=hd_mask)
            l_at = Lpart + b * stride_lb + heads * stride_lh
            tl.store(l_at + s, lse, mask=gmask)
            # the pair's last program with tokens merges their parts (every thread's part stored before the count)
            tl.debug_barrier()
            count = Count + b * tl.num_programs(1) + h
            if tl.atomic_add(count, 1, sem="acq_rel") == parts - 1:
                # a part a load, as (1, BLOCK_G heads, BLOCK_D) tiles, each thread summing its own (loading all
                # the parts as one tile measured 22-35 µs a batch-1 step slower on the H200: registers, a longer sum)
                offs_m = tl.arange(0, BLOCK_G)
                mmask = offs_m < G
                l_m = Lpart + b * stride_lb + (h * G + offs_m) * stride_lh
                o_m = Opart + b * stride_ob + (h * G + offs_m) * stride_oh
                offs_s = tl.arange(0, BLOCK_S)
                parts_lse = tl.load(l_m[None, :] + offs_s[:, None], mask=mmask[None, :] & (offs_s[:, None] < parts),
                                    other=float("-inf"), cache_modifier=".cg")  # (BLOCK_S, BLOCK_G)
                top = tl.max(parts_lse, 0)
                top = tl.where(top > float("-inf"), top, 0.0)
                w = tl.where(parts_lse > float("-inf"), tl.exp2(parts_lse - top[None, :]), 0.0)
                total = tl.sum(w, 0)
                merged = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
                for c in tl.static_range(0, BLOCK_S):  # (parts past the last unread)
                    offs_c = c + tl.arange(0, 1)
                    cmask = mmask[None, :] & (offs_c[:, None] < parts)
                    o_c = tl.load(o_m[None, :, None] + offs_c[:, None, None] * stride_os + offs_d[None, None, :],
                                  mask=cmask[:, :, None] & dmask[None, None, :], other=0.0, cache_modifier=".cg")
                    lse_c = tl.load(l_m[None, :] + offs_c[:, None], mask=cmask, other=float("-inf"),
                                    cache_modifier=".cg")
                    w_c = tl.where(lse_c > float("-inf"), tl.exp2(lse_c - top[None, :]), 0.0)
                    merged += tl.sum(o_c * w_c[:, :, None], 0)
                merged = merged / tl.where(total > 0, total, 1.0)[:, None] * v_scale
                tl.store(Out + b * stride_out_t + (h * G + offs_m)[:, None] * stride_out_h + offs_d[None, :],
                         merged.to(Out.dtype.element_ty), mask=mmask[:, None] & dmask[None, :])
                if WRITE_LSE:  # base 2, as FlashInfer's states (merged with them in cascade steps)
                    tl.store(Lse + b * stride_lse_b + h * G + offs_m, top + tl.log2(total), mask=mmask)
                tl.atomic_xchg(count, 0)


def decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, req_to_token: torch.Tensor,
           rows: torch.Tensor, prefix_lens: torch.Tensor, sm_scale: float, k_scale: float = 1.0,
           v_scale: float = 1.0, splits: int | None = None, return_lse: bool = False, block: int | None = None,
           num_warps: int | None = None, num_stages: int | None = None, starts: torch.Tensor | None = None,
           table_stride: int | None = None, f16: bool = False, new: tuple | None = None, widen: str | None = None,
           min_part: int | None = None, out: torch.Tensor | None = None, lse_out: torch.Tensor | None = None,
           pipe: bool | None = None):
    """q (B, Hq, D) — one new token per request, its K/V already in the pool — against positions
    0 (``starts[i]`` when given) .. prefix_lens[i] of table row ``rows[i]`` → (B, Hq, D) in q's
    dtype (with ``return_lse`` also the scores' log-sum-exp (B, Hq) float32, base 2 as FlashInfer's).

    k_cache / v_cache (S, Hkv, D) of any dtype; ``k_scale`` / ``v_scale``: what the pool's values
    are multiplied by to give K and V. With ``table_stride=1``, ``req_to_token`` is a flat list of
    slots and ``rows`` each request's offset in it (a CUDA graph's fixed buffers: the kernel must not
    read a table whose address may change). ``f16``: q, K, V and the probabilities multiplied in fp16
    (e4m3 widens to fp16 more cheaply than to bf16; q must fit fp16's range). ``new`` = (k, v, cos_sin,
    positions, slots, k_inv, v_inv): q and k (B, Hkv, D) are not rotated yet — the kernel rotates q, and
    writes the rotated k and v (quantized with ``k_inv`` / ``v_inv`` (Hkv,) unless None) at ``slots``
    of the caches before it reads them, as ``rope_store`` then ``decode`` (one launch). ``splits``,
    ``block``, ``num_warps``, ``num_stages``, ``pipe`` (each None: ``launch_config``'s, by batch size): the launch
    configuration (``pipe``: each block's table slots loaded in the iteration before, the same bits), and
    ``widen`` (None: ``widen_mode``) how such a pool's values are widened (benchmarks/gpu/fp8_decode_bench.py).
    ``out`` / ``lse_out``: where to write them ((B, Hq, D) in q's dtype, (B, Hq) float32; views of larger
    tensors are fine: their strides are the kernel's). ``min_part`` > 0: each split reads at least that many
    tokens (rounded up to the block), so that with more splits long contexts are spread over more programs while
    short ones leave theirs empty (None: ``decode_rules.min_part_tokens``); a program without tokens stores
    nothing, and a context in one part is stored by its program directly (no merge)."""
    bsz, hq, d = q.shape
    hkv = k_cache.shape[1]
    g = hq // hkv
    e4m3 = f16 and k_cache.dtype == torch.float8_e4m3fn
    cfg = launch_config(bsz, hkv, e4m3, splits)
    splits, min_part = cfg.splits, min_part_tokens() if min_part is None else min_part
    block, num_warps, num_stages = block or cfg.block, num_warps or cfg.warps, num_stages or cfg.stages
    pipe = cfg.pipe if pipe is None else pipe
    o_part = torch.empty((bsz, hq, splits, d), dtype=torch.float32, device=q.device)
    l_part = torch.empty((bsz, hq, splits), dtype=torch.float32, device=q.device)
    if out is None:
        out = torch.empty((bsz, hq, d), dtype=q.dtype, device=q.device)
    lse = l_part if not return_lse else lse_out if lse_out is not None else torch.empty(
        (bsz, hq), dtype=torch.float32, device=q.device)
    block_d = pow2_at_least(d)
    pdl = launch_pdl(q.device)
    kn, vn, cos_sin, pos, slots, k_inv, v_inv = new or (q, q, q, rows, rows, None, None)
    quant = k_inv is not None
    assert new is None or (block_d == d and kn.stride(2) == vn.stride(2) == 1 and cos_sin.shape[1] == d)
    mode = WIDEN_MODES[widen_mode(q.device, widen) if e4m3 else "cvt"]
    unit = 256.0 if mode else 1.0  # (widened values are value × 2^-8: see _widen_e4m3)
    warm = knobs()[3]
    asm = q.is_cuda and not _interpreting()  # (inline assembly: not in the interpreter)
    _partial_kernel[(bsz, hkv, splits)](
        q, k_cache, v_cache, req_to_token, rows, prefix_lens, prefix_lens if starts is None else starts, o_part, l_part,
        out, lse, _pair_counts(q.device, bsz * hkv),
        kn, vn, cos_sin, pos, slots, k_inv if quant else cos_sin, v_inv if quant else cos_sin,
        kn.stride(0), kn.stride(1), vn.stride(0), vn.stride(1), cos_sin.stride(0),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        req_to_token.stride(0) if table_stride is None else table_stride,
        o_part.stride(0), o_part.stride(1), o_part.stride(2), l_part.stride(0), l_part.stride(1),
        out.stride(0), out.stride(1), lse.stride(0),
        sm_scale * k_scale * unit * 1.4426950408889634, v_scale * unit,  # (exp2: log2 units)
        G=g, BLOCK_H=max(16, pow2_at_least(g)), D=d, BLOCK_D=block_d, BLOCK=block, SPLITS=splits,
        BLOCK_S=pow2_at_least(splits), HAS_START=starts is not None, F16=f16, WRITE_LSE=return_lse,
        PDL=pdl, ROPE=new is not None, QUANT=quant, FMAX=FP8_MAX, WIDEN=mode, MIN_PER=-(-min_part // block) * block,
        BLOCK_G=pow2_at_least(g),
        WARM=warm and new is not None and asm, PIPE=pipe,
        num_warps=num_warps, num_stages=num_stages,
        **({"launch_pdl": True} if pdl else {}),
    )
    return (out, lse) if return_lse else out


_counts: dict[torch.device, torch.Tensor] = {}


def _pair_counts(device: torch.device, pairs: int) -> torch.Tensor:
    """Zeroed int32 counts, one per (request, KV head) of a launch (each launch leaves them zero again): made by
    the first launch on a device — ``warm_up``'s, eager, before any CUDA graph captures one — at a fixed address."""
    if pairs > MAX_PAIRS:
        raise ValueError(f"triton decode: {pairs} (request, KV head) pairs, more than {MAX_PAIRS}")
    counts = _counts.get(device)
    if counts is None:
        counts = _counts[device] = torch.zeros(MAX_PAIRS, dtype=torch.int32, device=device)
    return counts
