"""What every service's entry point does first: tie its life to the launcher that started it, and
turn bad command-line input into one line instead of a traceback.

**Dying with the launcher.** ``banyan serve`` starts each service with ``BANYAN_LAUNCHER_PID`` in its
environment. ``tie_to_launcher`` (the first thing a service's ``main`` calls) asks Linux for
SIGKILL when the launcher dies (``prctl(PR_SET_PDEATHSIG)``; the service's own children do not
inherit it) and then checks that the launcher is still its parent: one that died between the fork
and the ``prctl`` is caught there. Where
``prctl`` is missing (not Linux) a daemon thread watches the parent pid instead. A launcher that is
killed hard (``kill -9``, the OOM killer) so takes every service with it: nothing keeps the ports or
the GPU. (The death signal follows the launcher *thread* that started the process: the launcher
starts every service from its main thread.)
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import dataclasses
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import NoReturn, TypeVar

from shared.config import ConfigError

LAUNCHER_ENV = "BANYAN_LAUNCHER_PID"
DEBUG_ENV = "BANYAN_DEBUG"
PR_SET_PDEATHSIG = 1
T = TypeVar("T")


def process_start(pid: int) -> str:
    """The start time of process ``pid`` (Linux: clock ticks since boot; "" where unknown or gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def process_age() -> float | None:
    """Seconds since this process started (Linux; None where unknown)."""
    try:
        with open("/proc/uptime") as f:
            return float(f.read().split()[0]) - int(process_start(os.getpid())) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError):
        return None


def tie_to_launcher(poll_s: float = 0.5) -> str:
    """Die with the launcher named in ``BANYAN_LAUNCHER_PID`` (removed from the environment: the
    service's own children are not the launcher's). Returns how: "prctl", "watch" or "" (not started
    by a launcher)."""
    raw = os.environ.pop(LAUNCHER_ENV, "")
    if not raw.isdigit():
        return ""
    launcher = int(raw)
    how = "prctl" if _set_death_signal(signal.SIGKILL) else "watch"
    if os.getppid() != launcher:  # it died before the prctl took effect: we were re-parented already
        os._exit(1)
    if how == "watch":
        watch_parent(launcher, poll_s)
    return how


def _set_death_signal(sig: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def watch_parent(parent: int, poll_s: float = 0.5) -> threading.Thread:
    """The fallback: a daemon thread that kills this process (SIGKILL, like the death signal) once
    its parent is no longer ``parent`` (it died and this process was re-parented)."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os.kill(os.getpid(), signal.SIGKILL)

    t = threading.Thread(target=watch, name="parent-watch", daemon=True)
    t.start()
    return t


def end_process(code: int = 0) -> NoReturn:
    """End a service whose work is done (from its main thread): its other (non-daemon) threads are
    waited for, the ``atexit`` handlers run (span exporters, metrics files) and the streams are
    flushed, as at a normal exit, but the interpreter is not torn down. At teardown Triton's nanobind extension reports the
    objects it keeps for the life of the process as ~30 lines of "nanobind: leaked 4 instances! …"
    (harmless, since the process is ending, yet every clean stop then looked like a crash)."""
    import atexit
    import logging

    # as the interpreter's own exit does, in its order: threading's exit hooks (thread pools told to
    # stop) and the join of non-daemon threads, then the atexit handlers
    threading._shutdown()
    atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed, or its reader gone
            pass
    os._exit(code)


# ---- one-line errors -----------------------------------------------------------------------------
class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are one line (its usage text runs to dozens of lines
    with every flag), plus ``--debug``."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.add_argument("--debug", action="store_true", default=os.environ.get(DEBUG_ENV, "") not in ("", "0"),
                          help=f"show tracebacks of configuration errors [env {DEBUG_ENV}]")

    def error(self, message: str) -> NoReturn:
        fail(self.prog, message + f" ({self.prog} --help lists the flags)")


def fail(prog: str, message: str, code: int = 2) -> NoReturn:
    print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(code)


def as_flags(message: str, *classes: type) -> str:
    """A configuration message with the config fields it names written as their flags
    (``max_running_requests must be >= 1`` → ``--max-running-requests must be >= 1``)."""
    names = {f.name for cls in classes for f in dataclasses.fields(cls)}
    return re.sub(r"(?<![\w-])[a-z][a-z0-9]*(?:_[a-z0-9]+)+(?![\w-])",
                  lambda m: "--" + m.group(0).replace("_", "-") if m.group(0) in names else m.group(0), message)


def configured(prog: str, debug: bool, build: Callable[[], T], *classes: type) -> T:
    """``build()``, with a ``ConfigError`` reported as one line (exit code 2; the traceback too with
    ``--debug``)."""
    try:
        return build()
    except ConfigError as e:
        if debug:
            raise
        fail(prog, as_flags(str(e), *classes))
