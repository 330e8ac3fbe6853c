"""How long a worker's start-up phases took: logged once, read by operators and the benchmark suite."""

from __future__ import annotations

import os
import time


class Laps:
    """Seconds each start-up phase took, in order (the ``model_loaded`` line's ``startup_s``); ``process`` is the
    process's age when the first lap started (interpreter, imports, the TP group) where Linux says it."""

    def __init__(self) -> None:
        self.t = time.perf_counter()
        self.s: dict[str, float] = {}
        try:
            with open("/proc/self/stat") as f, open("/proc/uptime") as u:
                started = int(f.read().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
                self.s["process"] = round(float(u.read().split()[0]) - started, 2)
        except (OSError, ValueError, IndexError):
            pass

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        self.s[name] = round(self.s.get(name, 0.0) + now - self.t, 2)
        self.t = now
