"""``banyan serve``'s run directory: ``banyan-<launcher pid>-<random>`` under the temp dir, private
to its user, holding the services' ipc sockets, the tokenizers' port files and metrics files, and
an ``owner`` file (JSON: the launcher's pid, its start time, the fixed ports it serves on).

The launcher removes it on every exit it lives to make. One killed hard (``kill -9``, the OOM
killer) cannot, so every start sweeps away the run directories whose owner is gone: its pid no
longer exists, or belongs to a process that started at another time (a reused pid). A directory
whose owner is alive is never touched, and neither is one without an owner file (not ours)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass

from shared.entry import process_start

PREFIX = "banyan-"
OWNER = "owner"


def alive(pid: int, start: str = "") -> bool:
    """Process ``pid`` exists (and, given ``start``, is the one that started then)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: it exists
        pass
    return not start or process_start(pid) in ("", start)


@dataclass(frozen=True)
class Owner:
    path: str
    pid: int
    start: str
    ports: tuple[int, ...]

    @property
    def alive(self) -> bool:
        return alive(self.pid, self.start)


def owners(root: str | None = None) -> list[Owner]:
    """The run directories under ``root`` (default: the temp dir) that have an owner file."""
    root = root or tempfile.gettempdir()
    out = []
    try:
        names = [n for n in os.listdir(root) if n.startswith(PREFIX)]
    except OSError:
        return []
    for name in names:
        path = os.path.join(root, name)
        try:
            with open(os.path.join(path, OWNER)) as f:
                o = json.load(f)
            out.append(Owner(path, int(o["pid"]), str(o.get("start", "")), tuple(int(p) for p in o.get("ports", ()))))
        except (OSError, ValueError, KeyError, TypeError):
            continue  # not a run directory (or not ours to read)
    return out


def sweep(root: str | None = None) -> list[str]:
    """Remove the run directories whose owning launcher is gone; returns them."""
    removed = []
    for o in owners(root):
        if not o.alive:
            shutil.rmtree(o.path, ignore_errors=True)
            if not os.path.exists(o.path):
                removed.append(o.path)
    return removed


def owner_of_port(port: int, root: str | None = None) -> Owner | None:
    """A live Banyan launcher that serves on ``port``, if its run directory says so."""
    return next((o for o in owners(root) if port in o.ports and o.alive), None)


class RunDir:
    """This launcher's run directory (created private: mode 0700)."""

    def __init__(self, ports: list[int], root: str | None = None) -> None:
        self.path = tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=root)
        owner = {"pid": os.getpid(), "start": process_start(os.getpid()), "ports": sorted(set(ports))}
        with open(os.path.join(self.path, OWNER + ".tmp"), "w") as f:
            json.dump(owner, f)
        os.replace(os.path.join(self.path, OWNER + ".tmp"), os.path.join(self.path, OWNER))

    def join(self, *parts: str) -> str:
        return os.path.join(self.path, *parts)

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
