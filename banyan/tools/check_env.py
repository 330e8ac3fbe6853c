"""``banyan check-env``: can this host serve? One row per check, a table, exit 0/1.

Each check returns a ``Row``: ``ok``, ``warn`` (serving works, but not at its best: no FlashInfer
kernels compiled yet, a small /dev/shm …), ``fail`` (``banyan serve`` would not start or not
serve: torch or xgrammar missing, a model that does not load, a port taken) or ``info`` (not
applicable here, e.g. no GPU: CPU serving works). The exit status is 1 when any row failed.
Nothing here starts a server or loads weights; the model check reads its config and loads its
tokenizer (the demo model is built first when it is not in the cache yet, as ``banyan serve`` would).
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import urllib.request
from dataclasses import asdict, dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from shared.entry import Parser

MIN_PYTHON = (3, 11)
SHM_ADVISED = 1 << 30  # NCCL (--tp > 1 on GPUs) and torch's shared tensors want more than Docker's 64 MiB


@dataclass(frozen=True)
class Row:
    check: str
    status: str  # ok | warn | fail | info
    detail: str


def _version(dist: str) -> str | None:
    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def check_python() -> Row:
    v = sys.version_info
    ok = v[:2] >= MIN_PYTHON
    return Row("python", "ok" if ok else "fail", f"{platform.python_version()} ({sys.executable})"
               + ("" if ok else f": Banyan needs >= {'.'.join(map(str, MIN_PYTHON))}"))


def check_torch() -> list[Row]:
    """torch, then CUDA, the driver and the GPUs (their absence is fine: CPU serving works)."""
    try:
        import torch
    except Exception as e:  # noqa: BLE001 — a broken install is reported, whatever it raises
        return [Row("torch", "fail", f"cannot import torch: {e}")]
    rows = [Row("torch", "ok", f"{torch.__version__} (CUDA build {torch.version.cuda or 'none: CPU only'})")]
    driver = _nvidia_driver()
    if not torch.cuda.is_available():
        rows.append(Row("cuda", "info", "no GPU visible: CPU serving works (the demo model and small models; slow "
                        "for large ones)" + (f"; an NVIDIA driver {driver} is installed but torch cannot use it"
                                             if driver else "")))
        return rows
    rows.append(Row("cuda", "ok", f"CUDA {torch.version.cuda}, {torch.cuda.device_count()} GPU(s) visible"
                    + (f", CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']}"
                       if "CUDA_VISIBLE_DEVICES" in os.environ else "")))
    rows.append(Row("driver", "ok" if driver else "warn", driver or "nvidia-smi not found (driver version unknown)"))
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        rows.append(Row(f"gpu {i}", "ok", f"{p.name}, {p.total_memory / 2**30:.0f} GiB, sm_{p.major}{p.minor}"))
    return rows


def _nvidia_driver() -> str:
    try:
        with open("/proc/driver/nvidia/version") as f:
            first = f.readline()
    except OSError:
        first = ""
    if first:  # "NVRM version: NVIDIA UNIX x86_64 Kernel Module  570.124.06  ..."
        words = [w for w in first.split() if w.count(".") >= 1 and w.replace(".", "").isdigit()]
        if words:
            return words[0]
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=10).stdout.split()
            return out[0] if out else ""
        except (OSError, subprocess.SubprocessError):
            return ""
    return ""


def flashinfer_kernels(jit_dir: str, prebuilt: str | None, nvcc: str | None) -> Row:
    """Where FlashInfer's compiled kernels come from: the ``flashinfer-jit-cache`` package (prebuilt),
    the JIT cache on disk (compiled by an earlier run), or nvcc at the first start (minutes)."""
    compiled = glob.glob(os.path.join(jit_dir, "**", "*.so"), recursive=True) if jit_dir else []
    if prebuilt:
        return Row("flashinfer kernels", "ok", f"prebuilt (flashinfer-jit-cache {prebuilt})"
                   + (f"; {len(compiled)} more compiled in {jit_dir}" if compiled else ""))
    if compiled:
        return Row("flashinfer kernels", "ok", f"{len(compiled)} compiled kernels in {jit_dir} (JIT cache)")
    if nvcc:
        return Row("flashinfer kernels", "warn", f"none compiled yet ({jit_dir or 'no JIT cache'}): the first start "
                   f"JIT-compiles them with {nvcc} (minutes); or pip install flashinfer-jit-cache")
    return Row("flashinfer kernels", "fail", "none compiled and no nvcc to compile them: install flashinfer-jit-cache "
               "(or the CUDA toolkit), or serve with --attention-backend torch")


def check_flashinfer(gpu: bool) -> list[Row]:
    v = _version("flashinfer-python") or _version("flashinfer")
    if v is None:
        if gpu:
            return [Row("flashinfer", "warn", "not installed: GPU serving falls back to torch attention and kernels "
                        "(slower); pip install -e '.[gpu]'")]
        return [Row("flashinfer", "info", "not installed (GPU only; CPU serving uses torch attention)")]
    row = Row("flashinfer", "ok", v)
    if not gpu:
        return [row, Row("flashinfer kernels", "info", "not used without a GPU")]
    jit_dir = ""
    try:
        from flashinfer.jit import env as fi_env  # the cache location FlashInfer itself uses

        jit_dir = str(getattr(fi_env, "FLASHINFER_JIT_DIR", "") or "")
    except Exception:  # noqa: BLE001 — fall back to FlashInfer's documented default
        pass
    if not jit_dir:
        jit_dir = os.path.join(os.environ.get("FLASHINFER_WORKSPACE_BASE", os.path.expanduser("~")), ".cache",
                               "flashinfer")
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or ""
    nvcc = shutil.which("nvcc") or (os.path.join(cuda_home, "bin", "nvcc")
                                   if cuda_home and os.path.exists(os.path.join(cuda_home, "bin", "nvcc")) else None)
    return [row, flashinfer_kernels(jit_dir, _version("flashinfer-jit-cache"), nvcc)]


def check_package(check: str, module: str, dist: str, why: str) -> Row:
    if importlib.util.find_spec(module) is None:
        return Row(check, "fail", f"not installed ({why}): pip install -e .")
    try:
        __import__(module)
    except Exception as e:  # noqa: BLE001
        return Row(check, "fail", f"cannot import {module}: {e}")
    v = _version(dist)
    return Row(check, "ok", f"{dist} {v}" if v else f"{dist} installed")  # (the package named: a row's check is not)


def check_grpc() -> Row:
    missing = [m for m in ("grpc", "grpc_health", "grpc_reflection", "grpc_status") if importlib.util.find_spec(m) is None]
    if missing:
        return Row("grpc", "fail", f"missing {', '.join(missing)}: pip install -e .")
    return Row("grpc", "ok", f"grpcio {_version('grpcio')}, health, reflection, status")


def check_model(model: str) -> list[Row]:
    """The model directory (the demo model: built into the cache when missing), its architecture,
    weights and tokenizer (loaded the way a tokenizer replica loads it)."""
    from banyan.cli import resolve

    try:
        model_dir, name = resolve(model)
    except Exception as e:  # noqa: BLE001 — a ConfigError's one line, or whatever the resolution raised
        return [Row("model", "fail", str(e) or type(e).__name__)]
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        return [Row("model", "fail", f"{model_dir}: cannot read config.json: {e}")]
    from services.worker.models import supported_architectures

    archs = cfg.get("architectures") or []
    known = [a for a in archs if a in supported_architectures()]
    weights = glob.glob(os.path.join(model_dir, "*.safetensors"))
    size = sum(os.path.getsize(w) for w in weights)
    if not known:
        row = Row("model", "fail", f"{model_dir}: architecture {archs or '(none)'} is not supported "
                  f"({', '.join(supported_architectures())})")
    elif not weights:
        row = Row("model", "fail", f"{model_dir}: no *.safetensors weights")
    else:
        row = Row("model", "ok", f"{name}: {known[0]}, {len(weights)} safetensors file(s), {size / 2**30:.2f} GiB, "
                  f"context {cfg.get('max_position_embeddings', '?')} ({model_dir})")
    try:
        from services.tokenizer.text import TextProcessor

        text = TextProcessor(model_dir)
        tok = Row("tokenizer", "ok", f"loads: {len(text.tokenizer)} tokens, chat template "
                  f"{'yes' if text.has_chat_template else 'no (text and token ids only)'}")
    except Exception as e:  # noqa: BLE001
        tok = Row("tokenizer", "fail", f"{model_dir}: the tokenizer does not load: {str(e).splitlines()[0][:200]}")
    return [row, tok]


def check_port(what: str, host: str, port: int) -> Row:
    """Free when a plain bind (no SO_REUSEPORT, which would share it with a server already there)
    succeeds; when taken, say whether a Banyan answers on it."""
    if port <= 0:
        return Row(f"port {what}", "info", "off" if port < 0 else "0: a free port is picked")
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        try:
            s.bind((host, port))
            return Row(f"port {what}", "ok", f"{host}:{port} is free")
        except OSError as e:
            taken = e
    who = "another process"
    if what == "http":
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if "status" in json.loads(r.read() or b"{}"):
                    who = "a server answering /health (another banyan serve?)"
        except Exception:  # noqa: BLE001 — whoever it is does not speak our /health
            pass
    flag = {"grpc": "--grpc-port", "http": "--http-port"}.get(what, "")
    return Row(f"port {what}", "fail", f"{host}:{port} is taken by {who} ({taken.strerror}): stop it, or pick another "
               f"port with {flag}")


def check_shm(path: str = "/dev/shm") -> Row:
    try:
        st = os.statvfs(path)
    except OSError as e:
        return Row("shared memory", "warn", f"{path}: {e.strerror} (NCCL and torch shared tensors need it)")
    size, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    detail = f"{path}: {size / 2**30:.2f} GiB, {free / 2**30:.2f} GiB free"
    if size < SHM_ADVISED:
        return Row("shared memory", "warn", detail + " — small for --tp > 1 on GPUs (NCCL); in Docker: --shm-size=2g "
                   "or shm_size in compose")
    return Row("shared memory", "ok", detail)


def _writable(path: Path) -> bool:
    """Whether ``path`` (a directory) is or can be made writable: its nearest existing ancestor is a directory this
    process may write into."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path.is_dir() and os.access(path, os.W_OK | os.X_OK)


def check_caches(gpu: bool) -> list[Row]:
    """Banyan's own caches on disk: the CUDA decode linear nvcc builds at the first GPU start
    (``$BANYAN_KERNEL_CACHE``) and the start-up tunings' decisions (``$BANYAN_TUNING_CACHE``). Not writable, a GPU
    worker serves without the CUDA kernel / times its kernels again at every start (tens of seconds)."""
    from services.worker.kernels import tuning_cache
    from services.worker.kernels.cuda_gemv import cache_dir

    rows, kernels, tuning = [], cache_dir(), tuning_cache.directory()
    built = sorted(kernels.glob("gemv_*.so")) if kernels.is_dir() else []
    if not gpu:
        rows.append(Row("kernel cache", "info", f"{kernels}: not used without a GPU"))
    elif built:
        rows.append(Row("kernel cache", "ok", f"{len(built)} built CUDA decode libraries in {kernels}"))
    elif _writable(kernels):
        rows.append(Row("kernel cache", "ok", f"{kernels}: empty, the first start builds the CUDA decode linear"))
    else:
        rows.append(Row("kernel cache", "warn", f"{kernels} is not writable: the CUDA decode linear cannot be built "
                        "(slower batch-1 decode); set BANYAN_KERNEL_CACHE to a writable directory"))
    if tuning is None:
        rows.append(Row("tuning cache", "info", "off (BANYAN_TUNING_CACHE=0): every GPU start times its kernels"))
    elif not gpu:
        rows.append(Row("tuning cache", "info", f"{tuning}: not used without a GPU"))
    elif not _writable(tuning):
        rows.append(Row("tuning cache", "warn", f"{tuning} is not writable: every start times its kernels again "
                        "(tens of seconds); set BANYAN_TUNING_CACHE to a writable directory"))
    else:
        kept = sorted(tuning.glob("*.json")) if tuning.is_dir() else []
        rows.append(Row("tuning cache", "ok", f"{tuning}: " + (f"{len(kept)} decision files" if kept else
                        "empty, the first start times the kernels and keeps its decisions")))
    return rows


def check_knobs() -> Row:
    """The ``BANYAN_*`` variables of ``shared/knobs.py`` this environment sets, each parsed as the services will."""
    from shared import knobs

    try:
        knobs.load()
    except knobs.KnobError as e:
        return Row("knobs", "fail", str(e))
    given = [f"{env}={value}" for env, _, value, _ in knobs.describe() if value != "default"]
    return Row("knobs", "ok", (f"{len(given)} set: {', '.join(given)}" if given else "none set (every default)")
               + f"; {len(knobs.KNOBS)} declared (banyan check-env --knobs lists them)")


def knobs_table() -> str:
    """Every declared knob: its variable, kind, the value here and its meaning."""
    from shared import knobs

    rows = knobs.describe()
    w, k = max(len(r[0]) for r in rows), max(len(r[1]) for r in rows)
    return "\n".join(f"{env:<{w}}  {kind:<{k}}  {value:<8}  {meaning}" for env, kind, value, meaning in rows)


def run_checks(model: str, host: str, grpc_port: int, http_port: int) -> list[Row]:
    rows = [check_python(), check_knobs()]
    rows += check_torch()
    gpu = any(r.check == "cuda" and r.status == "ok" for r in rows)
    rows += check_flashinfer(gpu)
    if any(r.check == "torch" and r.status == "ok" for r in rows):
        rows += check_caches(gpu)
    rows.append(check_package("xgrammar", "xgrammar", "xgrammar", "structured output"))
    rows.append(check_grpc())
    rows.append(check_package("zmq", "zmq", "pyzmq", "the services' links"))
    rows.append(check_package("transformers", "transformers", "transformers", "tokenizers, chat templates"))
    rows.append(check_package("http api", "fastapi", "fastapi", "the OpenAI-compatible API"))
    if any(r.check == "torch" and r.status == "ok" for r in rows):
        rows += check_model(model)
    else:
        rows.append(Row("model", "fail", "not checked: torch is missing"))
    rows.append(check_port("grpc", host, grpc_port))
    rows.append(check_port("http", host, http_port))
    rows.append(check_shm())
    return rows


MARK = {"ok": "OK", "warn": "WARN", "fail": "FAIL", "info": "--"}


def table(rows: list[Row]) -> str:
    w = max(len(r.check) for r in rows)
    lines = [f"{'check':<{w}}  {'status':<6}  detail", f"{'-' * w}  ------  ------"]
    lines += [f"{r.check:<{w}}  {MARK[r.status]:<6}  {r.detail}" for r in rows]
    return "\n".join(lines)


def verdict(rows: list[Row]) -> str:
    failed = [r.check for r in rows if r.status == "fail"]
    if failed:
        return f"NOT READY: {', '.join(failed)} failed (see above)"
    gpu = any(r.check == "cuda" and r.status == "ok" for r in rows)
    warns = [r.check for r in rows if r.status == "warn"]
    return ("ready to serve" + (" on the GPU" if gpu else " on the CPU (no GPU)")
            + (f"; warnings: {', '.join(warns)}" if warns else ""))


def main(argv: list[str] | None = None) -> int:
    env = os.environ.get
    ap = Parser(prog="banyan check-env", description=(
        "Check that this host can serve: Python, torch, CUDA/driver/GPUs, FlashInfer and its compiled kernels, "
        "Banyan's kernel and tuning caches, xgrammar, gRPC, the model and its tokenizer, the serving ports, /dev/shm. "
        "Exit 0 when everything needed to serve is there (no GPU is fine: CPU serving works), 1 otherwise."))
    ap.add_argument("--model", default=env("BANYAN_MODEL", ""),
                    help="model to check (as banyan serve --model; empty: the demo model) [env BANYAN_MODEL]")
    ap.add_argument("--host", default=env("BANYAN_HOST", "0.0.0.0"), help="listen host of the ports [env BANYAN_HOST]")
    ap.add_argument("--grpc-port", type=int, default=int(env("BANYAN_GRPC_PORT", 50051)),
                    help="gRPC port banyan serve would use [env BANYAN_GRPC_PORT, default 50051]")
    ap.add_argument("--http-port", type=int, default=int(env("BANYAN_HTTP_PORT", 8000)),
                    help="HTTP port banyan serve would use (-1: none) [env BANYAN_HTTP_PORT, default 8000]")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    ap.add_argument("--knobs", action="store_true", help="list every BANYAN_* knob (shared/knobs.py) and exit")
    ns = ap.parse_args(argv)
    if ns.knobs:
        print(knobs_table())
        return 0
    rows = run_checks(ns.model, ns.host, ns.grpc_port, ns.http_port)
    ok = not any(r.status == "fail" for r in rows)
    if ns.json:
        print(json.dumps({"ok": ok, "checks": [asdict(r) for r in rows]}, indent=1))
    else:
        print(table(rows))
        print()
        print(verdict(rows))
    return 0 if ok else 1
