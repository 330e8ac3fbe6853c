"""Every ``BANYAN_*`` environment variable that is not a service-config flag, declared once.

Service settings are ``shared/config.py`` fields (a ``--flag`` and its ``BANYAN_<FIELD>`` variable). What is left
is declared here, each with its type, default and a one-line meaning:

- ``internal``: switches that tests, benchmarks and A/B runs need (a kernel path on or off, a launch override); an
  operator leaves them unset. ``fingerprint`` marks the ones that change a tuned kernel or the library path it is
  timed against: the tuning cache's file name hashes their values (``fingerprint()``).
- ``host``: where a process keeps its caches and what it traces, per host.
- ``cli``: defaults of the launcher's and the clients' own flags (``banyan serve --tp``, ``banyan bench --target``).
- ``process``: set by the launcher for the processes it starts.

Code reads them through ``get(name)``: parsed and checked once a process, at its first read (a worker reads them
all at start-up: ``load()``); a bad value is a ``KnobError`` naming the variable. ``banyan check-env`` lists them
with the values this environment gives. Tests that change one call ``reload()`` after ``monkeypatch.setenv``.
``tests/shared/test_knobs.py`` fails on any ``BANYAN_*`` name in ``services/``, ``shared/`` or ``banyan/`` that is
neither declared here nor a config field.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from shared.config import ConfigError


class KnobError(ConfigError):
    """An environment variable of the registry has a value it does not take (a service reports it as its config
    errors: one line, exit code 2)."""


@dataclass(frozen=True)
class Knob:
    name: str  # how code asks for it: get("fp8_fast_accum")
    type: type  # bool (1/0), int or str
    default: Any
    meaning: str
    kind: str = "internal"  # internal | host | cli | process
    choices: tuple = ()  # the values it takes (empty: any of its type)
    fingerprint: bool = False  # changes a tuned kernel or its library baseline: part of the tuning cache's key

    @property
    def env(self) -> str:
        return "BANYAN_" + self.name.upper()

    def parse(self, raw: str) -> Any:
        try:
            if self.type is bool:
                if raw not in ("0", "1"):
                    raise ValueError
                value: Any = raw == "1"
            else:
                value = self.type(raw)
        except ValueError:
            raise KnobError(f"{self.env}={raw!r}: not a {self.type.__name__}"
                            + (" (1 or 0)" if self.type is bool else "")) from None
        if self.choices and value not in self.choices:
            raise KnobError(f"{self.env}={raw!r}: one of {', '.join(map(str, self.choices))}")
        return value


_I, _H, _C, _P = "internal", "host", "cli", "process"
KNOBS: dict[str, Knob] = {k.name: k for k in (
    # --- kernels (services/worker/kernels, quant): each default is the measured winner ---
    Knob("fp8_fast_accum", bool, True, "FP8 GEMMs sum on the tensor cores without float32 promotion (FP8 W2 "
         "1.24x -> 1.32x bf16 on the H100); 0: promoted every tile, as cuBLAS without fast accumulation",
         fingerprint=True),
    Knob("fp8_fused_quant", bool, True, "the norm / activation before an FP8 linear quantizes its output itself "
         "(one kernel less a linear); 0: the separate per-token quantization", fingerprint=True),
    Knob("gemm", str, "all", "our Triton GEMM tuned against the library at start-up: all, fp8 (FP8 weights only) "
         "or 0 (the library only)", choices=("all", "fp8", "0"), fingerprint=True),
    Knob("cuda_norm", bool, True, "our add-RMSNorm kernel (norm.cu) for rows <= 8; 0: FlashInfer's",
         fingerprint=True),
    Knob("triton_pdl", bool, True, "Triton kernels launched overlapping the kernel before (PDL, sm_90): FP8 W1 "
         "2.67 -> 2.60 ms on the H200; 0: plain launches", fingerprint=True),
    # --- the Triton decode attention (services/worker/attention/decode_rules.py) ---
    Knob("rope_in_decode", bool, True, "pure-decode steps rotate q/k and write K/V inside the Triton decode "
         "(one launch a layer less); 0: rope_store, then the decode"),
    Knob("decode_triton_rows", int, 255, "decode rows up to which --decode-attention auto takes the Triton decode "
         "on a bf16/fp16 pool (FP8 pools: always)"),
    Knob("fp8_widen", str, "asm", "how an FP8 pool's e4m3 values widen to fp16 in the Triton decode",
         choices=("cvt", "int", "asm")),
    Knob("decode_block", int, 0, "context tokens an iteration of every Triton decode launch (0: the launch rules)",
         choices=(0, 16, 32, 64, 128)),
    Knob("decode_warps", int, 0, "warps of every Triton decode launch (0: the launch rules)"),
    Knob("decode_stages", int, 0, "software-pipeline stages of every Triton decode launch (0: the launch rules)",
         choices=(0, 1, 2, 3, 4, 5, 6)),
    Knob("decode_pipe", str, "", "table slots a block ahead in every Triton decode launch: 1 all, 0 none, unset: "
         "the pipelined bands", choices=("", "0", "1")),
    Knob("decode_min_part", int, 0, "context tokens each split of a Triton decode reads at least (0: the context "
         "spread over all splits, measured faster)"),
    Knob("decode_warm", bool, True, "the first block's table slots prefetched into L1 beside the rope's loads"),
    # --- the runner and the cache tiers ---
    Knob("piecewise_write", bool, True, "the rope + K/V write inside the piecewise graphs (0: outside, eager)"),
    Knob("hicache_faults", str, "", "tests: copy faults injected into the host/disk tier (host_pool.Faults)"),
    Knob("check_integrity", bool, False, "tests and debugging: the scheduler checks the KV books every step"),
    # --- per host ---
    Knob("cache_dir", str, "", "Banyan's cache folder (default $XDG_CACHE_HOME/banyan or ~/.cache/banyan)", _H),
    Knob("kernel_cache", str, "", "where built CUDA libraries are kept (default <cache folder>/kernels)", _H),
    Knob("tuning_cache", str, "", "where the start-up tunings' decisions are kept (default <cache folder>/tuning; "
         "0: off)", _H),
    Knob("step_trace", str, "", "a JSON-lines file the worker appends one record a step to (empty: none)", _H),
    # --- defaults of the launcher's and the clients' flags ---
    Knob("dp_size", int, 1, "banyan serve --dp: model replicas", _C),
    Knob("num_tokenizers", int, 1, "banyan serve --num-tokenizers: tokenizer replicas sharing the ports", _C),
    Knob("ready_file", str, "", "banyan serve / top --ready-file: written once the server is ready", _C),
    Knob("restart_window", float, 600.0, "banyan serve --restart-window: seconds a restart counts against "
         "--max-restarts", _C),
    Knob("worker_restart_window", float, 600.0, "the old name of BANYAN_RESTART_WINDOW", _C),
    Knob("max_restarts", int, 3, "banyan serve --max-restarts", _C),
    Knob("max_worker_restarts", int, 3, "the old name of BANYAN_MAX_RESTARTS", _C),
    Knob("address", str, "", "banyan bench / the frontend: the server's gRPC address", _C),
    # --- set by the launcher ---
    Knob("launcher_pid", int, 0, "the launcher's pid: a service dies with it (shared/entry.py)", _P),
    Knob("debug", str, "", "services log at debug level (any value but empty or 0)", _P),
)}
ENV_NAMES = frozenset(k.env for k in KNOBS.values())

_values: dict[str, Any] | None = None
_on_reload: list[Callable[[], None]] = []  # caches of values read from here (hot paths that cache what they read)


def load(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Every knob's value from ``environ`` (default: this process's), checked → {name: value}; kept for ``get``
    (a runner's start-up calls it: what it reads holds until the next start). Clears what ``on_reload`` registered."""
    global _values
    env = os.environ if environ is None else environ
    values = {}
    for k in KNOBS.values():
        raw = env.get(k.env)
        values[k.name] = k.default if raw is None or (raw == "" and k.type is not str) else k.parse(raw)
    _values = values
    for fn in _on_reload:
        fn()
    return values


def reload() -> None:
    """Read the environment again at the next ``get`` (tests that set a variable)."""
    global _values
    _values = None
    for fn in _on_reload:
        fn()


def on_reload(fn: Callable[[], None]) -> None:
    """Call ``fn`` at every ``reload()`` (a module that caches a derived value clears it)."""
    _on_reload.append(fn)


def get(name: str, fresh: bool = False) -> Any:
    """A knob's value (read once a process; ``fresh``: from the environment as it is now, for the per-host paths
    that a process reads rarely); KeyError for a name the registry does not declare."""
    knob = KNOBS[name]
    if fresh:
        raw = os.environ.get(knob.env)
        return knob.default if raw is None or (raw == "" and knob.type is not str) else knob.parse(raw)
    values = _values if _values is not None else load()
    return values[knob.name]


def is_set(name: str) -> bool:
    """Whether the environment gives the knob a value other than its default."""
    return get(name) != KNOBS[name].default


def fingerprint(fresh: bool = False) -> dict[str, Any]:
    """The values of the knobs that change a tuned kernel (``Knob.fingerprint``), for the tuning cache's key."""
    return {k.name: get(k.name, fresh) for k in KNOBS.values() if k.fingerprint}


def given() -> dict[str, str]:
    """The registry's variables this environment sets, as set (logged at a worker's start)."""
    return {k.env: os.environ[k.env] for k in KNOBS.values() if k.env in os.environ}


def describe() -> list[tuple[str, str, str, str]]:
    """(variable, kind, value here — "default" when unset —, meaning) of every knob: ``banyan check-env``."""
    rows = []
    for k in KNOBS.values():
        raw = os.environ.get(k.env)
        rows.append((k.env, k.kind, "default" if raw is None else raw, f"{k.meaning} [default {k.default!r}]"))
    return rows
