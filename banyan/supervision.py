"""What ``banyan serve`` does when one of its processes exits: how it ended (exit code or signal),
whether it may be restarted and after how long, and the restart counter it publishes.

A restart *unit* is what is started again together: a scheduler's group (the scheduler and its
worker ranks) when the scheduler exits, a group's worker ranks when one of them exits, a tokenizer
replica. Each unit has its own budget — at most ``limit`` restarts within any ``window_s`` — and
backs off: the first restart is at once, and each further one of a process that keeps exiting
within ``STABLE_S`` of its start waits 1 s, then 2 s, 4 s … (at most ``MAX_BACKOFF_S``). A unit out
of budget stops the server (exit code 1) with one line naming it; one that kept dying young is
called a crash loop."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field

STABLE_S = 60.0  # a process that ran this long before exiting was not crash-looping
MAX_BACKOFF_S = 8.0
COUNTER_FILE = "counter_launcher.db"  # prometheus_client multiprocess format: counter_<id>.db
RESTARTS = "banyan:service_restarts"
RESTARTS_HELP = "Service processes restarted by the launcher after they exited, by the process that exited"


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


def kind_of(name: str) -> str:
    """``scheduler-1`` → ``scheduler``; ``worker-0`` → ``worker``; ``tokenizer-1`` → ``tokenizer``."""
    return name.split("-", 1)[0]


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


@dataclass
class _Unit:
    budget: RestartBudget
    young: int = 0  # exits in a row within STABLE_S of the start
    deaths: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class Verdict:
    restart: bool
    delay_s: float = 0.0  # wait this long before starting it again
    reason: str = ""  # why not (one line), when not


class RestartPolicy:
    """Per unit: the budget and the back-off (see the module's doc)."""

    def __init__(self, limit: int, window_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.limit, self.window_s, self.clock = limit, window_s, clock
        self._units: dict[str, _Unit] = {}

    def exited(self, unit: str, ran_s: float) -> Verdict:
        """A process of ``unit`` exited after running ``ran_s`` seconds: restart it, when?"""
        u = self._units.setdefault(unit, _Unit(RestartBudget(self.limit, self.window_s, self.clock)))
        now = self.clock()
        u.deaths = [t for t in u.deaths if now - t < self.window_s] + [now]
        u.young = u.young + 1 if ran_s < STABLE_S else 0
        if u.budget.take():
            return Verdict(True, min(2.0 ** (u.young - 2), MAX_BACKOFF_S) if u.young > 1 else 0.0)
        if self.limit == 0:
            return Verdict(False, reason="restarts are off (--max-restarts 0)")
        loop = f"a crash loop ({u.young} exits in a row within {STABLE_S:.0f} s of the start): " if u.young > 1 else ""
        return Verdict(False, reason=f"{loop}it exited {len(u.deaths)} times within {self.window_s:.0f} s, "
                                     f"--max-restarts {self.limit} per --restart-window")

    def used(self, unit: str) -> int:
        u = self._units.get(unit)
        return u.budget.used if u else 0


class RestartCounter:
    """``banyan:service_restarts_total{service}``, written where the tokenizers' metrics are: the run's
    prometheus_client multiprocess directory, whose files every tokenizer replica's ``/metrics``
    sums. So the counter is scraped with the rest on the HTTP port, and no port is added. (The file
    is the launcher's own — ``counter_launcher.db`` — in prometheus_client's format; the directory
    goes with the run directory.)"""

    def __init__(self, directory: str, services: list[str]) -> None:
        from prometheus_client.mmap_dict import MmapedDict

        self._file = MmapedDict(os.path.join(directory, COUNTER_FILE))
        self._counts: dict[str, float] = {}
        for s in services:  # present from the start, at 0
            self._write(s, 0.0)

    def _write(self, service: str, value: float) -> None:
        from prometheus_client.mmap_dict import mmap_key

        self._counts[service] = value
        key = mmap_key(RESTARTS, RESTARTS + "_total", ("service",), (service,), RESTARTS_HELP)
        self._file.write_value(key, value, 0.0)

    def inc(self, service: str) -> None:
        self._write(service, self._counts.get(service, 0.0) + 1)

    def close(self) -> None:
        self._file.close()
