"""cuBLASLt's other algorithms for a bf16/fp16 linear (``lt.cu``): what its heuristic proposes beyond the one
F.linear runs, as configs the start-up GEMM tuning (``gemm.tune``) times beside its own and keeps only where
correct and ≥ 3 % faster than the library.

``lt.cu`` says why. Here: the build (nvcc, host code only, against the cuBLASLt headers of torch's CUDA wheels or
the toolkit — ``BANYAN_CUBLAS_INCLUDE`` names a folder), the ctypes calls on torch's current stream (CUDA graphs
capture them), and ``LtConfig``: the heuristic's rank, its 64-byte algorithm descriptor (valid for this cuBLAS
version and device only: the tuning cache's fingerprint carries both) and the workspace it needs at the range's
largest M, allocated per call from torch's allocator (a graph keeps its own; streams never share one).
Opt-in until measured on the GPU: ``BANYAN_GEMM_LT=1`` offers the candidates (built 2026-12-05 after the session's
device time was spent). No CUDA, no nvcc or no headers: none, and the rest stands.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from services.worker.kernels.nvcc import arch_flag, build_library

Tensor = torch.Tensor
log = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("lt.cu")
MAX_ALGOS = 8  # the heuristic's candidates timed per shape and range of M
MAX_WORKSPACE = 32 << 20  # bytes an algorithm may ask for (split-K partial sums)
DTYPES = {torch.bfloat16: 0, torch.float16: 1}
_state: dict[str, object] = {}  # "lib": the loaded library or None once tried; "error": why not
_failed: set[tuple] = set()  # (config, M, N, K) that cuBLASLt refused at run time: the library instead, said once


@dataclass(frozen=True)
class LtConfig:
    rank: int  # in the heuristic's list for the range's largest M (0: its first choice)
    algo: str  # cublasLtMatmulAlgo_t, 64 bytes, hex
    workspace: int  # bytes

    def __str__(self) -> str:
        return f"lt{self.rank}"


def include_dirs() -> list[Path]:
    """Folders holding ``cublasLt.h``: ``BANYAN_CUBLAS_INCLUDE``, torch's CUDA wheels (``nvidia/*/include``,
    ``nvidia/cublas/include``), the toolkit's."""
    found = []
    if os.environ.get("BANYAN_CUBLAS_INCLUDE"):
        found.append(Path(os.environ["BANYAN_CUBLAS_INCLUDE"]))
    try:
        import nvidia

        for root in map(Path, nvidia.__path__):
            found += sorted(root.glob("*/include"))
    except ImportError:
        pass
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            found.append(Path(home) / "include")
    return [d for d in found if (d / "cublasLt.h").is_file()]


def build(arch: str, nvcc: str | None = None, out_dir: Path | None = None, include: Path | None = None) -> Path:
    """``lt.cu`` compiled for ``arch`` against ``include`` (else the first of ``include_dirs()``) → the library."""
    include = include or next(iter(include_dirs()), None)
    if include is None:
        raise RuntimeError("cublasLt.h not found (BANYAN_CUBLAS_INCLUDE, torch's nvidia wheels, CUDA_HOME)")
    header = (include / "cublasLt.h").read_bytes()
    return build_library((SOURCE,), f"lt_{arch}", arch.encode() + header, [f"-arch={arch}", f"-I{include}", "-ldl"],
                         nvcc, out_dir)


def library() -> ctypes.CDLL | None:
    """The loaded library (built on first call) or None — the reason in ``unavailable()``."""
    if "lib" in _state:
        return _state["lib"]
    _state["lib"] = None
    try:
        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA device")
        lib = ctypes.CDLL(str(build(arch_flag(torch.cuda.get_device_capability()))))
        i64, i32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
        lib.banyan_lt_algos.argtypes = [i32, i32, i32, i32, i64, i32, ptr, ptr]
        lib.banyan_lt_check.argtypes = [i32, i32, i32, i64, i64, i64, i32, ptr, ptr]
        lib.banyan_lt_matmul.argtypes = [ptr, ptr, ptr, i32, i32, i32, i64, i64, i64, i32, ptr, ptr, i64, ptr]
        for fn in (lib.banyan_lt_algos, lib.banyan_lt_check, lib.banyan_lt_matmul):
            fn.restype = i32
        _state["lib"] = lib
    except Exception as e:  # (no nvcc, no headers, a compiler problem: the other paths stand)
        _state["error"] = f"{type(e).__name__}: {e}"[:400]
        log.info("cublaslt algorithms unavailable: %s", _state["error"])
    return _state["lib"]


def unavailable() -> str | None:
    return _state.get("error")


def enabled() -> bool:
    """``BANYAN_GEMM_LT=1``: the tuning offers cuBLASLt's algorithms (read at start-up, not per call)."""
    return os.environ.get("BANYAN_GEMM_LT", "0") == "1"


def candidates(m: int, n: int, k: int, dtype: torch.dtype, lowest_m: int = 1) -> list[LtConfig]:
    """The heuristic's algorithms for (M, N, K) that also run at ``lowest_m`` rows (a range's both ends), best-ranked
    first; [] without the library, for another dtype or unless ``BANYAN_GEMM_LT=1``."""
    if dtype not in DTYPES or not enabled() or (lib := library()) is None:
        return []
    algos, sizes = ctypes.create_string_buffer(64 * MAX_ALGOS), (ctypes.c_int64 * MAX_ALGOS)()
    got = lib.banyan_lt_algos(m, n, k, DTYPES[dtype], MAX_WORKSPACE, MAX_ALGOS, algos, sizes)
    if got < 0:
        log.info("cublaslt heuristic failed for %dx%dx%d (status %d): no candidates", m, n, k, -got)
    out = []
    for rank in range(max(0, got)):
        blob = algos.raw[64 * rank:64 * (rank + 1)]
        need = ctypes.c_int64()
        if lib.banyan_lt_check(lowest_m, n, k, k, k, n, DTYPES[dtype], blob, ctypes.byref(need)) == 0:
            out.append(LtConfig(rank, blob.hex(), max(int(sizes[rank]), int(need.value))))
    return out


@functools.cache
def _descriptor(algo: str) -> bytes:
    return bytes.fromhex(algo)  # (once a config, not every call)


def matmul(x: Tensor, w: Tensor, cfg: LtConfig) -> Tensor | None:
    """x (M, K) @ w (N, K)^T with ``cfg``'s algorithm on the current stream; None where cuBLASLt refuses it (the
    caller runs the library's)."""
    lib = library()
    m, k = x.shape
    n = w.shape[0]
    if lib is None or x.dtype not in DTYPES or w.dtype != x.dtype or x.stride(1) != 1 or w.stride(1) != 1:
        return None
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    space = torch.empty(cfg.workspace, dtype=torch.uint8, device=x.device) if cfg.workspace else None
    status = lib.banyan_lt_matmul(x.data_ptr(), w.data_ptr(), y.data_ptr(), m, n, k, x.stride(0), w.stride(0), n,
                                  DTYPES[x.dtype], _descriptor(cfg.algo), None if space is None else space.data_ptr(),
                                  cfg.workspace, torch.cuda.current_stream(x.device).cuda_stream)
    if status == 0:
        return y
    if (cfg, m, n, k) not in _failed:
        _failed.add((cfg, m, n, k))
        log.warning("cublaslt %s refused %dx%dx%d (status %d): the library's GEMM instead", cfg, m, n, k, status)
    return None
