"""How long a worker's start-up phases took: logged once, read by operators and the benchmark suite."""

from __future__ import annotations

import time

from shared.entry import process_age


class Laps:
    """Seconds each start-up phase took, in order (the ``model_loaded`` line's ``startup_s``); ``process`` is the
    process's age when the first lap started (interpreter, imports, the TP group) where Linux says it."""

    def __init__(self) -> None:
        self.t = time.perf_counter()
        self.s: dict[str, float] = {}
        age = process_age()
        if age is not None:
            self.s["process"] = round(age, 2)

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        self.s[name] = round(self.s.get(name, 0.0) + now - self.t, 2)
        self.t = now
