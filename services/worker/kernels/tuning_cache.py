"""The start-up tunings' decisions kept on disk, so a server that starts again on the same machine skips the
timing (``small_m.tune``, ``gemm.tune``: tens of seconds for an 8B model) and compiles only the kernels it uses.

A file per fingerprint under ``BANYAN_TUNING_CACHE`` (default ``<Banyan's cache folder>/tuning``, e.g.
``~/.cache/banyan/tuning``; ``0`` turns the cache off): the device (name, capability, SMs: a MIG slice differs),
the torch / CUDA / Triton versions, a hash of every kernel source and of the library path they are timed against,
and the values of the knobs that change a kernel or that path (``shared/knobs.py``: those marked ``fingerprint``).
Anything else and the decisions are not reused. A cached choice is checked for correctness again before it is used
(one call against float32, as the tuning checks it), and a shape whose choice fails is timed again.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
import tempfile
from pathlib import Path

import torch

from shared import knobs
from shared.model_path import cache_root

_HERE = Path(__file__).resolve().parent
SOURCES = (*sorted(p for p in _HERE.iterdir() if p.suffix in (".py", ".cu", ".cuh")), _HERE.parent / "quant" / "fp8.py",
           _HERE.parent / "numerics.py")
VERSION = 1  # of the file's layout


def directory() -> Path | None:
    """Where the decisions live; None when ``BANYAN_TUNING_CACHE=0``."""
    given = knobs.get("tuning_cache", fresh=True)
    if given == "0":
        return None
    return Path(given).expanduser() if given else cache_root() / "tuning"


def fingerprint(device: torch.device) -> str:
    """What a decision depends on besides the shape, hashed."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    from services.worker.numerics import fast_accum

    props = torch.cuda.get_device_properties(device)
    sources = hashlib.sha256()
    for path in SOURCES:
        sources.update(path.name.encode() + b"\0" + path.read_bytes())
    parts = {"version": VERSION, "device": props.name, "capability": [props.major, props.minor],
             "sms": props.multi_processor_count, "torch": torch.__version__, "cuda": torch.version.cuda,
             "triton": triton_version, "sources": sources.hexdigest(), "fast_accum": fast_accum(),
             "knobs": knobs.fingerprint(fresh=True)}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:20]


def encode(cfg) -> dict | None:
    return None if cfg is None else {"type": type(cfg).__name__, **dataclasses.asdict(cfg)}


def decode(entry: dict | None, classes: tuple[type, ...]):
    """A config from ``encode``'s dict (one of ``classes``); None for the library or a type no longer known."""
    if entry is None:
        return None
    fields = dict(entry)
    name = fields.pop("type", None)
    cls = next((c for c in classes if c.__name__ == name), None)
    try:
        return None if cls is None else cls(**fields)
    except TypeError:  # (a field renamed: the shape is timed again)
        return None


def reuse(hit: tuple[object, str] | None, check) -> bool:
    """Whether a cached (config, report part) stands: the library's always, a config's when ``check(config)`` still
    passes on this process's kernels (one that raises, e.g. a CUDA library that no longer builds, does not)."""
    if hit is None or hit[0] is None:
        return hit is not None
    try:
        return bool(check(hit[0]))
    except Exception:
        return False


class Decisions:
    """One tuning's cached decisions on one device: ``get`` a shape's, ``put`` new ones, ``save`` once at the end.
    Keys are the report's names plus the activation dtype; values the (top M, config) picks and report parts."""

    def __init__(self, kind: str, path: Path | None):
        self.kind, self.path, self.dirty = kind, path, False
        entries = self._read().get(kind) if path is not None else None
        self.entries: dict = entries if isinstance(entries, dict) else {}

    @classmethod
    def on(cls, kind: str, device: torch.device) -> Decisions:
        """The decisions of ``kind`` for ``device`` (none kept off CUDA or with the cache off)."""
        root = directory()
        return cls(kind, None if root is None or device.type != "cuda" else root / f"{fingerprint(device)}.json")

    def _read(self) -> dict:
        try:
            doc = json.loads(self.path.read_text())
            return doc if isinstance(doc, dict) else {}
        except (OSError, ValueError):  # (none yet, or a torn / foreign file: tuned again and rewritten)
            return {}

    def get(self, name: str, dtype: torch.dtype, classes: tuple[type, ...]) -> dict[int, tuple[object, str]]:
        """{top M: (config or None, its report part)} of a shape decided before; {} when it was not."""
        entry = self.entries.get(f"{name} @{dtype}")
        try:
            return {int(top): (decode(cfg, classes), str(said)) for top, cfg, said in entry["picks"]
                    if cfg is None or decode(cfg, classes) is not None}
        except (TypeError, KeyError, ValueError, AttributeError):  # (none, or not this layout: timed again)
            return {}

    def put(self, name: str, dtype: torch.dtype, picks: list[tuple[int, object]], said: list[str]) -> None:
        self.entries[f"{name} @{dtype}"] = {"picks": [[top, encode(cfg), s] for (top, cfg), s in zip(picks, said)]}
        self.dirty = True

    def save(self) -> None:
        """Merge this tuning's decisions into the file (written whole, then renamed: a reader never sees half), under
        a lock: the ranks of a tensor-parallel worker save theirs at the same time, each its own shard's shapes."""
        if self.path is None or not self.dirty:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path.with_suffix(".lock"), "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # (released when closed)
                doc = self._read()
                doc[self.kind] = {**(doc[self.kind] if isinstance(doc.get(self.kind), dict) else {}), **self.entries}
                with tempfile.NamedTemporaryFile("w", dir=self.path.parent, suffix=".tmp", delete=False) as f:
                    json.dump(doc, f, indent=1, sort_keys=True)
                os.replace(f.name, self.path)
            self.dirty = False
        except OSError:  # (a read-only home: the next start times again)
            pass
