"""A per-step timeline of rank 0's worker, for locating device idle between steps
(the ``step_trace`` knob, ``BANYAN_STEP_TRACE=FILE``: one JSON line a step, appended; off when unset).

Each line: the step id and kind, its rows and tokens, and host times in ms since the worker
started — ``recv`` (the batch taken off the socket), ``queued`` (its launch returned), ``answered``
(its results sent), and ``t`` (the wall clock when answered, seconds: the stage log lines' clock) —
with the device's busy and idle ms as the step metrics measure them.
``benchmarks/gpu/step_trace.py`` summarizes a file: where the idle sits, and what came before it
(the scheduler's turnaround: ``recv`` of N+2 minus ``answered`` of N; the worker's queueing)."""

from __future__ import annotations

import json
import time
from typing import TextIO

from shared import knobs


class StepTrace:
    def __init__(self, path: str | None = None) -> None:
        path = path if path is not None else knobs.get("step_trace", fresh=True)
        self._file: TextIO | None = open(path, "a", buffering=1) if path else None  # noqa: SIM115 (process-long)
        self._t0 = time.perf_counter()
        self._open: dict[int, tuple[float, float]] = {}  # step id -> (recv, queued), until answered

    def queued(self, step: int, recv: float, queued: float) -> None:
        if self._file is not None:
            self._open[step] = (recv, queued)

    def answered(self, step: int, kind: str, rows: int, tokens: int, busy_s: float, idle_s: float) -> None:
        if self._file is None:
            return
        recv, queued = self._open.pop(step, (float("nan"), float("nan")))
        ms = lambda t: round((t - self._t0) * 1e3, 3)  # noqa: E731
        self._file.write(json.dumps({"step": step, "kind": kind, "rows": rows, "tokens": tokens, "recv": ms(recv),
                                     "queued": ms(queued), "answered": ms(time.perf_counter()), "t": time.time(),
                                     "device_ms": round(busy_s * 1e3, 3), "idle_ms": round(idle_s * 1e3, 3)}) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
