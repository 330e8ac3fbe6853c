"""``@function`` programs: ``run`` one, ``run_batch`` many concurrently."""

from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from banyan.lang.backend import Backend, default_backend
from banyan.lang.state import ProgramState


class Program:
    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        functools.update_wrapper(self, fn)

    def run(self, *args: Any, backend: Backend | None = None, **kwargs: Any) -> ProgramState:
        s = ProgramState(backend or default_backend())
        self.fn(s, *args, **kwargs)
        return s

    def run_batch(self, batch: list[dict[str, Any]], backend: Backend | None = None, num_threads: int = 16,
                  progress_bar: bool = False) -> list[ProgramState]:
        """Run the program once per argument dict, ``num_threads`` at a time; results in order."""
        backend = backend or default_backend()
        bar = None
        if progress_bar:
            from tqdm import tqdm

            bar = tqdm(total=len(batch), unit="program")

        def one(kwargs: dict[str, Any]) -> ProgramState:
            s = self.run(backend=backend, **kwargs)
            if bar is not None:
                bar.update(1)
            return s

        try:
            with ThreadPoolExecutor(max(1, num_threads)) as pool:
                return list(pool.map(one, batch))
        finally:
            if bar is not None:
                bar.close()

    def __call__(self, *args: Any, **kwargs: Any) -> ProgramState:
        return self.run(*args, **kwargs)


def function(fn: Callable[..., Any]) -> Program:
    """Decorate ``def prog(s, ...)`` to make a runnable program."""
    return Program(fn)
