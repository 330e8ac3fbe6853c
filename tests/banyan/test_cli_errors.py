"""Every ``banyan`` command's error paths: one line on stderr (no traceback) and a non-zero exit —
a bad flag, a model that is not there, a server that does not answer — and the frontend library's
examples the same; the library itself raises ``bn.ServerUnreachable`` (a ``bn.ServerError``)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from banyan.cli import COMMANDS
from tests.support import ROOT


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then closed: refused until someone takes it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict[str, str]:
    hub = tmp_path_factory.mktemp("hub")  # an empty Hugging Face cache, offline
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_CACHE": str(hub),
            "HF_HUB_OFFLINE": "1", "BANYAN_DEBUG": ""}


def banyan(env: dict, *args: str, cwd=ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "banyan.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)


def one_line(r: subprocess.CompletedProcess, code: int | None = None) -> str:
    """The error line; nothing else on stderr but progress bars (``run_batch(progress_bar=True)``)."""
    lines = [ln for ln in r.stderr.strip().splitlines() if "%|" not in ln]
    assert r.returncode != 0 and (code is None or r.returncode == code), (r.returncode, r.stderr[-2000:])
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    return lines[0]


def cases() -> list[tuple[str, list[str], int, str]]:
    """(command, args, exit code, what the line says); {port}: a port nobody listens on."""
    out = [(cmd, ["--no-such-flag"], 2, "the following arguments are required" if cmd == "convert"
            else "unrecognized arguments: --no-such-flag") for cmd in COMMANDS]
    out += [
        ("serve", ["--model", "nobody/no-such-model"], 2, "hf download nobody/no-such-model"),
        ("worker", ["--model", "/no/such/dir"], 2, "neither a directory nor a Hugging Face hub id"),
        ("scheduler", ["--page-size", "0"], 2, "--page-size must be >= 1"),
        ("tokenizer", ["--model", "nobody/no-such-model"], 2, "hf download"),
        ("bench", ["--target", "127.0.0.1:{port}"], 1, "no server answers at 127.0.0.1:{port} (Connection refused)"),
        ("bench", ["--target", "127.0.0.1:{port}", "--vocab-size", "100", "--num-prompts", "2", "--no-progress"], 1,
         "all 2 requests failed: no server answers"),
        ("bench", ["--backend", "openai", "--target", "http://127.0.0.1:{port}"], 1, "Connection refused"),
        ("top", ["--once", "127.0.0.1:{port}"], 1, "Connection refused"),
        ("top", ["--ready-file", "/no/such/banyan.ready"], 1, "no ready file /no/such/banyan.ready: no `banyan serve"),
        ("check-env", ["--grpc-port", "x"], 2, "invalid int value"),
        ("convert", ["/no/such/model.gguf", "out"], 1, "/no/such/model.gguf"),
    ]
    return out


@pytest.mark.parametrize("cmd,args,code,says", cases(), ids=lambda x: x if isinstance(x, str) else None)
def test_error_is_one_line(env, tmp_path, cmd, args, code, says) -> None:
    port = str(closed_port())
    r = banyan(env, cmd, *(a.replace("{port}", port) for a in args), cwd=tmp_path)
    line = one_line(r, code)
    assert line.startswith(f"banyan {cmd}: error: ") and says.replace("{port}", port) in line, line
    assert not list(tmp_path.glob("bench-*")), "a failed bench wrote results"


def test_unknown_command_is_one_line(env) -> None:
    line = one_line(banyan(env, "frobnicate"), 2)
    assert "unknown command 'frobnicate'" in line and "check-env" in line


def test_debug_shows_the_traceback(env) -> None:
    r = banyan({**env, "BANYAN_DEBUG": "1"}, "bench", "--target", f"127.0.0.1:{closed_port()}")
    assert r.returncode != 0 and "Traceback" in r.stderr and "_InactiveRpcError" in r.stderr


def test_the_hub_hint_names_a_command_that_exists(env) -> None:
    """`hf download` (huggingface-hub's CLI, the version Banyan installs) is there and takes the id."""
    import shutil

    from shared.model_path import download_command

    cmd = download_command("owner/name").split()
    assert shutil.which(cmd[0]), f"{cmd[0]} is not on PATH"
    r = subprocess.run([*cmd[:2], "--help"], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0 and "repo_id" in r.stdout.lower().replace("-", "_"), r.stdout[-2000:] + r.stderr[-2000:]


@pytest.mark.parametrize("example", sorted(p.name for p in (ROOT / "examples").glob("*.py")))
def test_examples_without_a_server_are_one_line(env, example) -> None:
    address = f"127.0.0.1:{closed_port()}"
    r = subprocess.run([sys.executable, str(ROOT / "examples" / example), address], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    line = one_line(r, 1)
    assert f"no server answers at {address}" in line, line


def test_the_library_raises_server_unreachable() -> None:
    import banyan as bn

    address = f"127.0.0.1:{closed_port()}"
    with bn.Backend(address, timeout=30) as backend, pytest.raises(bn.ServerUnreachable) as e:
        backend.text_ids("Hello", True)
    assert isinstance(e.value, bn.ServerError) and e.value.code == "UNAVAILABLE" and e.value.address == address
    assert f"no server answers at {address}" in str(e.value)
