"""Host↔device copies that never wait for the device: the step path must not synchronize, so the
next step can be prepared (and queued) while the current one runs (overlap scheduling).

A plain ``torch.tensor(..., device="cuda")`` or ``.to("cuda")`` from pageable memory ends with a
stream synchronization; these go through pinned memory (PyTorch's caching host allocator keeps a
block alive until its copy has run) with ``non_blocking=True``. On the CPU they are plain copies.
"""

from __future__ import annotations

import time

import numpy as np
import torch


def to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list / array as a device tensor, without waiting for the device."""
    t = torch.from_numpy(values) if isinstance(values, np.ndarray) else torch.tensor(values)
    t = t.to(dtype)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class HostCopy:
    """Device tensors copied to the host asynchronously; ``get`` waits for them (and only them)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.event: torch.cuda.Event | None = None
        self.host: dict[str, torch.Tensor] = {}
        for name, t in tensors.items():
            if t.device.type == "cuda":
                h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                h.copy_(t, non_blocking=True)
                self.host[name] = h
            else:
                self.host[name] = t
        if any(t.device.type == "cuda" for t in tensors.values()):
            self.event = torch.cuda.Event()
            self.event.record()

    def ready(self) -> bool:
        return self.event is None or self.event.query()

    def get(self) -> dict[str, np.ndarray]:
        if self.event is not None:
            self.event.synchronize()
        return {k: v.numpy() for k, v in self.host.items()}


class DeviceTimer:
    """Busy time of each step on the device and the idle gap before it (GPU clock on CUDA: events
    recorded when the step's first and last work reach the stream; host clock on the CPU)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._prev_end = None

    def start(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def end(self):
        return self.start()

    def measure(self, start, end, follows: bool) -> tuple[float, float]:
        """(busy seconds of this step, idle seconds since the previous step's end — 0 unless the
        step ``follows`` the previous one without the scheduler having been idle). Call once the
        step's end has been reached (after its outputs were copied back)."""
        prev, self._prev_end = self._prev_end, end
        if self.cuda:
            end.synchronize()  # (TP ranks > 0 copy nothing back: nothing else waited for the step)
            busy = start.elapsed_time(end) / 1e3
            idle = prev.elapsed_time(start) / 1e3 if follows and prev is not None else 0.0
        else:
            busy = end - start
            idle = start - prev if follows and prev is not None else 0.0
        return busy, max(idle, 0.0)
