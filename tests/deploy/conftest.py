"""The Docker engine and images for the deploy tier (scripts/docker_ci.sh, once per session), both
compose implementations, and the engine stopped at the end when this session started it."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.support import ROOT

STATE = Path(os.environ.get("BANYAN_DOCKER_STATE", "/var/tmp/banyan-docker"))


def run(cmd: list[str], timeout: float, env: dict[str, str] | None = None, cwd: Path = ROOT
        ) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)


def explain(r: subprocess.CompletedProcess) -> str:
    return f"{r.args} exited {r.returncode}\n--- stdout\n{r.stdout[-6000:]}\n--- stderr\n{r.stderr[-6000:]}"


def docker() -> str:
    """Debian's (or Docker CE's) CLI in /usr/bin (matches its daemon), else whichever is on PATH."""
    return "/usr/bin/docker" if os.path.exists("/usr/bin/docker") else "docker"


def daemon_up() -> bool:
    try:
        return run([docker(), "info"], 60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.fixture(scope="session")
def docker_images() -> None:
    """The Docker engine running and the images built (scripts/docker_ci.sh, idempotent). A
    dockerd that was not running before is stopped when the session ends (`docker_ci.sh stop`:
    only the one it started, and not while containers still run)."""
    was_up = daemon_up()
    r = run(["bash", str(ROOT / "scripts" / "docker_ci.sh")], timeout=1800)
    assert r.returncode == 0, (
        "the Docker engine or the Banyan images are not available (scripts/docker_ci.sh failed; it installs "
        "Debian's docker.io/docker-compose when no engine is there, starts dockerd and builds the images):\n"
        + explain(r))
    yield
    if not was_up:
        stop = run(["bash", str(ROOT / "scripts" / "docker_ci.sh"), "stop"], timeout=120)
        print(f"\n{stop.stderr.strip()}")
        assert stop.returncode == 0, explain(stop)


@pytest.fixture(scope="session")
def composes(docker_images, tmp_path_factory) -> dict[str, tuple[list[str], dict[str, str]]]:
    """{"v1": (argv, env), "v2": (argv, env)}: Debian's docker-compose 1.29, and compose v2 — the
    docker CLI's own plugin, else Debian trixie's (downloaded by docker_ci.sh, installed nowhere).
    ``env`` puts a ``docker`` with that plugin first on PATH, so ``docker compose`` is v2."""
    r = run(["bash", str(ROOT / "scripts" / "docker_ci.sh"), "compose-v1"], timeout=600)
    assert r.returncode == 0, explain(r)
    v1 = shutil.which("docker-compose") or "/usr/bin/docker-compose"
    shim = tmp_path_factory.mktemp("docker-shim")
    (shim / "docker").symlink_to(docker())
    env = {**os.environ, "PATH": f"{shim}{os.pathsep}{os.environ.get('PATH', '')}"}
    if run([docker(), "compose", "version"], 60).returncode != 0:
        plugin_dir = STATE / "compose-v2"
        r = run(["bash", str(ROOT / "scripts" / "docker_ci.sh"), "compose-v2", str(plugin_dir)], timeout=600)
        assert r.returncode == 0, "could not get compose v2:\n" + explain(r)
        env["DOCKER_CONFIG"] = str(plugin_dir)
    v = run([docker(), "compose", "version"], 60, env=env)
    assert v.returncode == 0 and re.search(r"version v?2\.", v.stdout), explain(v)
    return {"v1": ([v1], dict(os.environ)), "v2": ([docker(), "compose"], env)}
