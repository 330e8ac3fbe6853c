"""Which decode plans go to the Triton decode attention (``triton_decode``) and with what launch: the split
count, the block and the warps by batch size (a graph's launch is fixed at its capture), and the rows the
flashinfer backend's ``auto`` sends there. Measured on the H200 and the H100 (``benchmarks/gpu/fp8_decode_bench.py``)."""

from __future__ import annotations

import functools
import math
import os
from typing import NamedTuple

from shared import knobs as registry

BLOCK_N = 64  # context tokens a program reads per iteration
FP8_WIDE_BLOCK = 128  # context tokens an iteration for an FP8 pool at <= 2 splits (large batches)
MAX_PAIRS = 1 << 16  # (request, KV head) pairs a launch may have: the counts' size
MAX_SPLITS = 16
TARGET_PROGRAMS = 4 * 132  # ~4 programs per SM of an H100/H200 across (request, KV head, split)
MIN_PART = 0  # tokens a split reads at least (0: the context spread over all the splits)


SPLIT_COUNTS = tuple(1 << i for i in range(MAX_SPLITS.bit_length()))  # 1, 2, 4, 8, 16


def num_splits(batch: int, kv_heads: int, fp8: bool = False) -> int:
    """Splits per request: enough programs to fill the GPU at small batches, one at large ones; a
    power of two (each count is a kernel of its own, compiled by ``warm_up`` before serving). A
    function of the batch size only (a graph's launch grid is fixed at capture). ``fp8`` (an FP8 pool
    read in fp16): two splits up to ``FP8_TWO_SPLIT_PAIRS`` (request, KV head) pairs; a bf16/fp16 pool's up to
    ``TWO_SPLIT_PAIRS``."""
    want = min(MAX_SPLITS, math.ceil(TARGET_PROGRAMS / max(1, batch * kv_heads)))
    if batch * kv_heads <= (FP8_TWO_SPLIT_PAIRS if fp8 else TWO_SPLIT_PAIRS):
        want = max(want, 2)
    return 1 << (max(1, want).bit_length() - 1)  # (the power of two at or below)


# FP8 pool (fp8_decode_bench --spread 0.67 grid, H200, 8 KV heads, µs a layer, 2026-12-04):
# two splits beat one at 96 × 2,560 (143 vs 150) and 128 × 2,560 (183 vs 191), lose at 256 × 1,536 (224 vs 211);
# 64-token blocks on 2 warps beat 128 on 4 from 512 rows (512 × 768: 202 vs 219, 1,024 × 384: 213 vs 252,
# 1,024 × 1,536: 724 vs 780), level at 256 rows, lose at 128 (217 vs 191).
FP8_TWO_SPLIT_PAIRS = 1024
# bf16 pool (fp8_decode_bench --splits 1,2,4, H200, 8 KV heads, µs a layer, 2026-12-05):
# two splits beat one at 96 rows (96 × 1,024: 110 vs 118; 96 × 2,048: 206 vs 236), are level at 64 and 192, lose at
# 128 (145 vs 130).
TWO_SPLIT_PAIRS = 768
FP8_NARROW_PAIRS = 4096


class Launch(NamedTuple):
    """A Triton decode launch's configuration: (request, KV head) programs per request, context tokens a program
    reads per iteration, warps, software-pipeline stages, and whether each block's table slots are loaded in the
    iteration before (``pipelined``)."""
    splits: int
    block: int
    warps: int
    stages: int
    pipe: bool


# The pipelined bands: (request, KV head) pairs → a launch with each block's slots loaded a block ahead (None: the
# launch before them), by the top pairs of each range; measured on the H100 (132 SMs, as the H200), 8 KV heads,
# fp8_decode_bench's served launch against each candidate, µs a layer (2026-12-05, benchmarks/results/suite_h100_2026-12-05f).
# What decides is how full the last wave is: a 32-token block's program at 4 stages takes 53 KiB of shared memory
# (4 an SM: 528 a wave), at 3 stages 37 KiB (5 an SM: 660); an FP8 pool's 64-token one on 2 warps 4 an SM. One split
# wins where its programs fill their last wave (a program streams a longer part), two where one split's would not.
# bf16 (before: 2 splits of 64-token blocks, 2 stages, up to 96 rows): 32 × 1k 54.6 → 50.7, 48 × 1k 83.4 → 74.5,
# 64 × 1k 96.7 → 92.8, 64 × 2k 183.1 → 179.0 (4 stages); 80 × 1k 119.1 → 113.3 (3 stages; 4: 138.7); 96 × 1k 144.4
# → 141.1, 96 × 2k 277.0 → 271.0 (2 splits at 3 stages; 1 split at 3: 166.2); 112-160 rows: within 2 %, left.
# FP8 (before: 128-token blocks on 4 warps, 2 splits up to 128 rows): 32 × 1k 39.9 → 31.6 (2 splits); 48 × 1k
# 49.5 → 46.1, 64 × 1k 66.9 → 51.9, 64 × 2k 119.2 → 97.3 (1 split); 80-96 rows level or worse, left; 112 × 1k 106.7
# → 97.6, 128 × 1k 120.8 → 102.5, 128 × 2.5k 271.7 → 236.7 (1 split, two full waves); 160 rows 141.6 vs 144.3, left.
PIPE_BANDS: dict[bool, tuple[tuple[int, Launch | None], ...]] = {
    False: ((255, None), (528, Launch(1, 32, 4, 4, True)), (660, Launch(1, 32, 4, 3, True)),
            (768, Launch(2, 32, 4, 3, True))),
    True: ((255, None), (383, Launch(2, 64, 2, 3, True)), (528, Launch(1, 64, 2, 3, True)), (800, None),
           (1056, Launch(1, 64, 2, 3, True))),
}


def pipe_band(pairs: int, fp8: bool) -> Launch | None:
    """The pipelined launch of ``pairs`` (request, KV head) pairs (``PIPE_BANDS``), or None outside the bands."""
    for top, launch in PIPE_BANDS[fp8]:
        if pairs <= top:
            return launch
    return None


@functools.cache
def knobs() -> tuple[int | None, int | None, int, bool]:
    """(block, warps, min part) of every launch — None (``launch_config``'s rule) and ``MIN_PART`` unless the
    measurement knobs ``decode_block`` / ``decode_warps`` / ``decode_min_part`` (``shared/knobs.py``) say otherwise —
    and whether the first block's slots are prefetched into L1 with the rope inside (``decode_warm``). Cached: each
    decode launch asks (``registry.reload()`` clears it)."""
    return (registry.get("decode_block") or None, registry.get("decode_warps") or None,
            registry.get("decode_min_part") or MIN_PART, registry.get("decode_warm"))


@functools.cache
def pipelined() -> bool | None:
    """Whether launches load each block's table slots in the iteration before and its V with its K: None — by
    ``launch_config``'s rule (the pipelined band) — unless the ``decode_pipe`` knob is 1 (every launch, any pool) or
    0 (none: the launches before the band, an A/B knob). Why: one wave of programs at 32-96 rows read the pool at
    75-85 % of HBM bandwidth, two waves at 128 rows at 96 % (H200); the PTX shows Triton's pipeliner keeping one
    K/V buffer and waiting for it at the top of every iteration (the addresses come from a load in the same
    iteration), so a program has nothing in flight while it computes; with the slots a block ahead it keeps
    ``stages`` - 1 buffers in flight. The same products in the same order: the same bits."""
    pipe = registry.get("decode_pipe")
    return None if pipe == "" else pipe == "1"


@functools.cache
def plain_stages() -> int | None:
    """Software-pipeline stages of every launch if the ``decode_stages`` knob says, else None: ``launch_config``'s."""
    return registry.get("decode_stages") or None


def launch_config(batch: int, kv_heads: int, fp8: bool, splits: int | None = None) -> Launch:
    """The launch of ``batch`` requests (``fp8``: an FP8 pool read in fp16) — a function of the batch size (fixed
    at a graph's capture); ``splits`` overrides the count (and leaves the pipelined bands). Outside them: a
    bf16/fp16 pool's 64-token blocks on 4 warps, 2 stages; an FP8 pool's at <= 2 splits 128-token blocks on 4
    warps (64 on 2 from ``FP8_NARROW_PAIRS`` at one split), 3 stages. The measurement knobs override each field."""
    pairs, auto = batch * kv_heads, splits is None
    splits = splits or num_splits(batch, kv_heads, fp8)
    pipe = pipelined()
    band = pipe_band(pairs, fp8) if auto and pipe is not False else None
    if band is not None:
        cfg = band
    elif fp8 and splits <= 2:
        narrow = splits == 1 and pairs >= FP8_NARROW_PAIRS
        cfg = Launch(splits, BLOCK_N if narrow else FP8_WIDE_BLOCK, 2 if narrow else 4, 3, False)
    else:
        cfg = Launch(splits, BLOCK_N, 4, 3 if fp8 else 2, False)
    if pipe and not cfg.pipe:  # (BANYAN_DECODE_PIPE=1: every launch, a third stage for two buffers in flight)
        cfg = cfg._replace(pipe=True, stages=max(cfg.stages, 3))
    block, warps, _, _ = knobs()
    return cfg._replace(block=block or cfg.block, warps=warps or cfg.warps, stages=plain_stages() or cfg.stages)


def min_part_tokens() -> int:
    """Tokens each split of a launch reads at least (rounded up to the block): a short context then fills fewer
    programs, and one in a single part is stored without a merge (``knobs``: 0 unless ``BANYAN_DECODE_MIN_PART``;
    more, shorter parts measured faster on the H200)."""
    return knobs()[2]


AUTO_TRITON_ROWS = 255  # decode rows up to which "auto" takes this kernel on a bf16/fp16 pool (``triton_rows_up_to``)


def triton_rows_up_to(decode_kernel: str, device_type: str, quantized: bool) -> int:
    """The flashinfer backend sends a decode plan of r rows here when r <= this — every plan with ``decode_kernel``
    "triton", none with "flashinfer"; with "auto", every plan of an FP8 pool (FlashInfer's FP8-KV decode reads it at
    under half the bandwidth: W2 +4 %, W3 +7 % on the H200) and, on a bf16/fp16 pool, up to ``AUTO_TRITON_ROWS``
    rows (the ``decode_triton_rows`` knob): at up to 16 rows the context split over several programs a request
    (W1 4.43 → 4.29–4.38 ms); at 32–255 rows × 1,024 4–13 % faster a layer than FlashInfer's tensor-core decode,
    and no FlashInfer plan to make on the host (H200: the 64 × 1k decode step 7.57 → 7.33 ms, W2 level). From 256
    rows FlashInfer's (docs/decisions/0005-triton-decode-from-256-rows.md). 0 off CUDA."""
    if decode_kernel not in ("flashinfer", "triton", "auto"):
        raise ValueError(f"bad decode kernel {decode_kernel!r} (auto | flashinfer | triton)")
    if decode_kernel == "auto":
        return 0 if device_type != "cuda" else MAX_PAIRS if quantized else registry.get("decode_triton_rows")
    return MAX_PAIRS if decode_kernel == "triton" else 0


def mixed_decode_triton(decode_kernel: str, quantized: bool) -> bool:
    """Whether a mixed step's decode part takes the Triton decode where a decode-only step of as many rows
    would (``triton_rows_up_to``): with "auto", only on an FP8 pool (FlashInfer's FP8-KV decode is slow). On a
    bf16/fp16 pool FlashInfer's decode: its launch is less Python than Triton's, and an eager step pays that on the
    host — on the H200 16 decodes of 1,200 beside 64 / 256 prompt tokens queued in 9.3 / 6.1 ms against 12.6 / 11.8
    through Triton, for the same device time (9.4 / 11.6 ms vs 12.5 / 12.0)."""
    return decode_kernel != "auto" or quantized


WIDEN_MODES = {"cvt": 0, "int": 1, "asm": 2}
# (fp8_decode_bench, H200, µs a layer: 600 × 1,536 with 64-token blocks cvt 754, asm 767; with 128-token blocks —
# then bound by the widening — cvt 735, asm 605; 256 × 512: 131 (64, cvt) → 100 (128, asm).)
WIDEN_DEFAULT = "asm"


def widen_mode(device, mode: str | None = None) -> str:
    """How an FP8 pool's e4m3 values become the fp16 products' operands (``f16``): "cvt", the conversion
    instruction (one a pair, on the narrow conversion pipe); "int", integer operations on each value (the bit
    pattern of value × 2^-8, exact, subnormals included); "asm", the same on four values at a time in 32-bit
    registers (a byte permute, a shift, a mask: as ``kernels/gemv.cu`` widens FP8 weights). The ``fp8_widen`` knob
    overrides the default (cached: each FP8 decode launch asks), ``mode`` both; Triton's interpreter
    (CPU tests) has no inline assembly: "int" there."""
    mode = mode or _widen_knob()
    if mode not in WIDEN_MODES:
        raise ValueError(f"fp8 widen mode {mode!r} (cvt | int | asm)")
    if mode == "asm" and (device.type != "cuda" or _interpreting()):
        return "int"
    return mode


@functools.cache
def _widen_knob() -> str:
    return registry.get("fp8_widen")


for _cached in (knobs, pipelined, plain_stages, _widen_knob):
    registry.on_reload(_cached.cache_clear)


@functools.cache
def _interpreting() -> bool:
    """Whether Triton's interpreter runs the kernels (read once a process: each decode launch asks)."""
    return os.environ.get("TRITON_INTERPRET") == "1"
