"""What ``banyan serve`` does when one of its processes exits: how it ended (exit code or signal)
and how many worker-group restarts are left (at most N within a sliding window)."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable


def how_it_ended(returncode: int) -> str:
    """``-9`` → ``killed by SIGKILL``; ``1`` → ``exit code 1`` (``subprocess`` return codes)."""
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


def worker_group(name: str) -> str:
    """A worker rank's group: ``worker-0`` → ``worker``; ``worker-2-1`` (--dp) → ``worker-2``."""
    return name.rsplit("-", 1)[0]


class RestartBudget:
    """At most ``limit`` restarts within any ``window_s`` seconds (0: none)."""

    def __init__(self, limit: int, window_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.limit, self.window_s, self.clock = limit, window_s, clock
        self._times: list[float] = []

    def take(self) -> bool:
        """Use one restart now; False when the window's restarts are used up."""
        now = self.clock()
        self._times = [t for t in self._times if now - t < self.window_s]
        if len(self._times) >= self.limit:
            return False
        self._times.append(now)
        return True

    @property
    def used(self) -> int:
        """Restarts taken within the window (as of the last ``take``)."""
        return len(self._times)
