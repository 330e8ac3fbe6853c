"""The worker's numeric constants and small integer helpers: a leaf module (it imports nothing of the project
but the knob registry), so that the kernels, the FP8 code and the attention can all read them without importing
each other.

- ``FP8`` / ``FP8_MAX``: the e4m3 dtype every FP8 tensor of the worker uses and its largest finite value.
- ``fast_accum()``: whether FP8 GEMMs sum at the tensor cores' reduced precision (the ``fp8_fast_accum`` knob,
  on by default: FP8 W2 1.24x -> 1.32x bf16 on the H100; turned off at start-up where the library refuses it).
- ``cdiv`` / ``pow2_at_least``: ``triton.cdiv`` / ``triton.next_power_of_2`` without their cost (Triton 3.6 and
  3.9 wrap them as constexpr functions, ~1.9 us a host call — several a launch on the eager steps' paths).
"""

from __future__ import annotations

import torch

from shared import knobs

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
_fast_accum = {"on": knobs.get("fp8_fast_accum")}


def fast_accum() -> bool:
    return _fast_accum["on"]


def set_fast_accum(on: bool) -> bool:
    """Turn fast accumulation on or off (benchmarks; ``quant.fp8.check_scaled_mm``) → the setting before."""
    previous, _fast_accum["on"] = _fast_accum["on"], on
    return previous


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def pow2_at_least(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for n <= 1)."""
    return 1 << max(0, n - 1).bit_length()
