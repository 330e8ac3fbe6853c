"""Programmatic dependent launch (PDL) for this project's Triton kernels (Hopper and later).

The decode-size CUDA kernels (``gemv.cu``, ``norm.cu``) are launched to overlap the kernel before
them; a Triton kernel between two of them (the rope + K/V write, the decode attention) broke that
chain: it started only once the kernel before it had ended, and the linear after it could not start
its weight loads until it had ended too. Launched with PDL, such a kernel waits for the previous one
(``gdc_wait``) before it reads anything and at once lets the next one start (``gdc_launch_dependents``),
whose blocks then load what no kernel writes (weights) while it runs. The wait comes first, so
nothing a kernel reads is ever read early, and every kernel of the chain finishes after the one before.

``launch_pdl(device)``: whether launches on ``device`` use it — on unless ``BANYAN_TRITON_PDL=0``, on CUDA
capability ≥ 9 with a Triton that has the launch option, never in Triton's interpreter. Measured on the H200
(2026-12-05): FP8 W1's batch-1 graph 27 µs (context 256) and 11 µs (1,024) a replay faster, and W2
level with it off (5,959 vs 5,944 output tok/s in the same call). The GPU test runs it both ways.
"""

from __future__ import annotations

import functools
import os

import torch

from shared import knobs


@functools.cache
def _supported(index: int) -> bool:
    if not knobs.get("triton_pdl", fresh=True) or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    if "launch_pdl" not in getattr(CUDAOptions, "__dataclass_fields__", {}):
        return False
    return torch.cuda.get_device_capability(index)[0] >= 9


def launch_pdl(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    return _supported(device.index if device.index is not None else torch.cuda.current_device())
