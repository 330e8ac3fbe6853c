"""The README's Docker blocks, run as written: the compose v2 block with `docker compose` (v2) and
the v1 block with Debian's `docker-compose` 1.29 (tests/deploy/conftest.py provides both).

Changes to the run, none to the commands: each block runs under its own compose project
(``COMPOSE_PROJECT_NAME``, so a developer's own stack and other test projects are never touched)
with the proxy published on free loopback ports (``BANYAN_PUBLISH_*``; ``localhost:8000`` in the
block's curl line becomes that port), and after each ``up -d`` the test waits until every
container is healthy, as the README says to (``ps`` until healthy). The stack is always taken
down at the end.

Not run here, with the reason:
- the GPU block (``compose.gpu.yaml``): needs an NVIDIA GPU with the Container Toolkit, and Docker
  Hub for the CUDA base image; the lead runs it on a GPU host. Its configuration is checked with
  both compose versions (test_compose.py::test_compose_variants_are_valid);
- the monitoring block (``--profile monitoring``): its images (Prometheus, Grafana, the OTel
  collector) come from Docker Hub, which CI cannot reach; its configuration is checked the same way.
"""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from tests.deploy.conftest import docker, explain, run
from tests.readme_blocks import readme_blocks
from tests.support import ROOT, free_port

pytestmark = pytest.mark.timeout(2400)
DOCKER = ("docker compose", "docker-compose")
BLOCKS = [b for b in readme_blocks() if any(d in b.text for d in DOCKER)]
NOT_HERE = {"compose.gpu.yaml": "GPU + NVIDIA Container Toolkit + Docker Hub",
            "--profile monitoring": "images from Docker Hub",
            # a second engine and the gateway image (the `gateway` extra's 37 MB smg wheel) on top of the CPU
            # stack's build: the real gateway in front of two engines is tested without Docker in
            # tests/e2e/test_smg.py, and the profile's compose file is validated with the others
            "--profile gateway": "the gateway's behaviour: tests/e2e/test_smg.py"}
HEALTH_TIMEOUT_S = 300.0


def block(flavour: str):
    """The v2 block (``docker compose``) or the v1 block (``docker-compose``)."""
    word = "docker compose up -d" if flavour == "v2" else "docker-compose up -d"
    found = [b for b in BLOCKS if word in b.text and not any(n in b.text for n in NOT_HERE)]
    assert len(found) == 1, f"{len(found)} README blocks run {word!r}"
    return found[0]


def test_every_docker_block_is_run_or_explained() -> None:
    assert len(BLOCKS) == 5, [str(b) for b in BLOCKS]
    for b in BLOCKS:
        assert any(n in b.text for n in NOT_HERE) or b in (block("v1"), block("v2")), str(b)
    for needle in NOT_HERE:
        assert sum(needle in b.text for b in BLOCKS) == 1, needle
    v1, v2 = block("v1").text, block("v2").text
    assert "docker compose" not in v1 and "docker-compose" not in v2
    # the same commands, spelled for each version (comments aside)
    strip = lambda t: [ln.split("#")[0].strip().replace("docker-compose", "docker compose")  # noqa: E731
                       for ln in t.strip().splitlines()]
    assert strip(v1) == strip(v2)


def containers(project: str) -> list[dict]:
    ids = run([docker(), "ps", "-aq", "--filter", f"label=com.docker.compose.project={project}"], 30)
    assert ids.returncode == 0, explain(ids)
    if not ids.stdout.split():
        return []
    r = run([docker(), "inspect", *ids.stdout.split()], 30)
    assert r.returncode == 0, explain(r)
    return [{"service": c["Config"]["Labels"].get("com.docker.compose.service"), "status": c["State"]["Status"],
             "health": (c["State"].get("Health") or {}).get("Status")} for c in json.loads(r.stdout)]


def wait_healthy(project: str, tokenizers: int) -> None:
    deadline = time.monotonic() + HEALTH_TIMEOUT_S
    while True:
        cs = containers(project)
        assert not [c for c in cs if c["status"] in ("exited", "dead")], cs
        if sum(c["service"] == "tokenizer" for c in cs) == tokenizers and cs and all(
                c["health"] == "healthy" for c in cs):
            return
        assert time.monotonic() < deadline, f"{project} not healthy after {HEALTH_TIMEOUT_S:.0f} s: {cs}"
        time.sleep(1)


@pytest.mark.parametrize("flavour", ["v2", "v1"])
def test_readme_compose_block(flavour, composes) -> None:
    argv, base_env = composes[flavour]
    project = f"banyan-readme-{flavour}"
    http = free_port()
    env = {k: v for k, v in base_env.items() if not k.startswith(("BANYAN_", "COMPOSE_"))}
    env.update(COMPOSE_PROJECT_NAME=project, BANYAN_PUBLISH_HOST="127.0.0.1",
               BANYAN_PUBLISH_GRPC_PORT=str(free_port()), BANYAN_PUBLISH_HTTP_PORT=str(http))
    lines = [ln for ln in block(flavour).text.splitlines() if ln.strip()]
    down = [*argv, "down", "-v", "--remove-orphans", "--timeout", "5"]
    run(down, 180, env=env)  # leftovers of a killed run
    outputs: dict[str, str] = {}
    try:
        for line in lines:
            cmd = line.replace("localhost:8000", f"127.0.0.1:{http}")
            for attempt in range(10 if " logs " in cmd else 1):  # docker captures logs asynchronously
                r = subprocess.run(["bash", "-c", "set -o pipefail\n" + cmd], cwd=ROOT, env=env, capture_output=True,
                                   text=True, timeout=1800)
                if r.returncode == 0:
                    break
                time.sleep(1)
            assert r.returncode == 0, f"README line failed ({flavour}): {line}\n{explain(r)}"
            outputs[line] = r.stdout + r.stderr
            if " up -d" in cmd:  # a person watches `ps` until healthy before going on
                wait_healthy(project, 4 if "tokenizer=4" in cmd else 2)
        ps = next(out for ln, out in outputs.items() if ln.split("#")[0].strip().endswith(" ps"))
        assert ps.count("tokenizer") >= 4, ps
        grep = next(out for ln, out in outputs.items() if "grep" in ln)
        assert '"request_id": "my-id"' in grep and '"stage": "queued"' in grep, grep[-2000:]
        assert containers(project) == []  # the block's own `down`
    finally:
        r = run(down, 180, env=env)
        assert r.returncode == 0, explain(r)
