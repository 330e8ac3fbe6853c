"""Building Banyan's CUDA sources (``gemv.cu`` + ``norm.cu``) into shared libraries with nvcc, once per
source, build flags and nvcc version, under the kernel cache: ``$BANYAN_KERNEL_CACHE``, else ``kernels/`` in Banyan's
cache folder (``shared.model_path.cache_root``). The callers load them with ctypes."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from shared import knobs
from shared.model_path import cache_root


def cache_dir() -> Path:
    if given := knobs.get("kernel_cache", fresh=True):
        return Path(given).expanduser()
    return cache_root() / "kernels"


def find_nvcc() -> str | None:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and (Path(home) / "bin" / "nvcc").is_file():
        return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc") or (str(p) if (p := Path("/usr/local/cuda/bin/nvcc")).is_file() else None)


def arch_flag(capability: tuple[int, int]) -> str:
    major, minor = capability
    return f"sm_{major}{minor}{'a' if (major, minor) == (9, 0) else ''}"


def build_library(sources: tuple[Path, ...], stem: str, key_parts: bytes, flags: list[str], nvcc: str | None = None,
                  out_dir: Path | None = None, headers: tuple[Path, ...] = ()) -> Path:
    """``sources`` compiled by nvcc with ``flags`` into ``<stem>_<key>.so`` under ``out_dir`` (the kernel cache),
    unless there already — the key hashes the sources, ``headers``, ``key_parts`` and nvcc's version → its path.
    RuntimeError with nvcc's message when the build fails."""
    nvcc = nvcc or find_nvcc()
    if nvcc is None:
        raise RuntimeError("nvcc not found (CUDA_HOME, PATH)")
    src = b"".join(p.read_bytes() for p in sources + headers)
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout
    key = hashlib.sha256(src + key_parts + version.encode()).hexdigest()[:16]
    out_dir = out_dir or cache_dir()
    lib = out_dir / f"{stem}_{key}.so"
    if lib.is_file():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        tmp_lib = Path(tmp) / lib.name
        cmd = [nvcc, "-O3", *flags, "-shared", "-Xcompiler", "-fPIC", "-o", str(tmp_lib), *map(str, sources)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise RuntimeError(f"nvcc failed ({done.returncode}): {(done.stderr or done.stdout)[-800:]}")
        os.replace(tmp_lib, lib)  # (atomic: another process building the same finds a whole file)
    return lib
