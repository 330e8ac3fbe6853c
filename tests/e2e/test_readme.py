"""The README's command blocks, run as written on the demo model.

Every ```bash and ```python block of README.md is either run here or listed in ELSEWHERE /
handled by the Docker tier with the reason, and a block that is neither fails the test (so a new
block cannot go untested). How they run:

- one `banyan serve` (the README's first command, started by tests.support.Server) serves the
  examples; the only change to the blocks' text is the address: ``localhost:50051`` and
  ``localhost:8000`` become that server's free loopback ports (tests never depend on the default
  ports being free), ``/tmp/banyan.ready`` a temporary file. A `banyan serve` inside a block gets
  free ports from the environment (``BANYAN_GRPC_PORT=0``, ``BANYAN_HTTP_PORT=0``: every flag is
  also a variable), ``banyan bench`` its target from ``BANYAN_ADDRESS``;
- `pip install` parts are not run: no network at test time, and CI has just run that install
  (its test extra includes the otel packages);
- a bash block runs as one script (``set -e -o pipefail``: every line must succeed); the grpcurl
  command (grpcurl is not packaged by Debian or PyPI) is carried out as grpcurl does it, through
  server reflection: the method and its request type resolved from the server, the ``-d`` JSON
  parsed into that type.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from tests.readme_blocks import Block, matching, readme_blocks
from tests.support import ROOT, Server, free_port, make_tiny_model

BLOCKS = readme_blocks()
# needle (in exactly one block) → why it is not run by this module
ELSEWHERE = {
    "python3 -m pytest -q": "the test suite itself: CI runs this very command (.ci/run; checked below)",
    "scripts/install_client_toolchains.sh": "installs Debian's Go/Java toolchains (root, apt): "
                                            "tests/deploy/test_clients.py runs these scripts and both clients",
    "smg launch --host 0.0.0.0 --port 30000": "the real gateway in front of two engines (fixed public ports here): "
                                              "tests/e2e/test_smg.py runs `smg launch` with these flags on free "
                                              "ports and checks chat, completions, streaming, n, JSON schema",
}
DOCKER = ("docker compose", "docker-compose")  # tests/deploy/test_readme_docker.py: Docker tier


def docker_block(b: Block) -> bool:
    return any(d in b.text for d in DOCKER)


@pytest.fixture(scope="module")
def server(demo_dir, tmp_path_factory):
    s = Server(None, tmp_path_factory.mktemp("readme") / "server.log")
    yield s
    assert s.stop() == 0, s.log_text()[-3000:]  # (SIGTERM): a clean stop, and it looks like one
    leaks = [line for line in s.log_text().splitlines() if "nanobind" in line]
    assert not leaks and not Path(s.log_path).with_suffix(".ready").exists(), leaks[:5]


@pytest.fixture
def env(server, tmp_path) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "BANYAN_ADDRESS": server.target,
            "BANYAN_GRPC_PORT": "0", "BANYAN_HTTP_PORT": "0", "BANYAN_HOST": "127.0.0.1"}


def localize(text: str, server: Server, tmp: Path) -> str:
    return (text.replace("localhost:50051", server.target)
            .replace("localhost:8000", f"127.0.0.1:{server.http_port}")
            .replace("/tmp/banyan.ready", str(tmp / "banyan.ready")))


def run_block(b: Block, server: Server, env: dict, tmp: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    text = localize(b.text, server, tmp)
    if b.lang == "python":
        cmd = [sys.executable, "-c", text]
    else:  # every line must succeed; background jobs (`&`) are waited for
        cmd = ["bash", "-c", "set -e -o pipefail\n" + text + "\nwait\n"]
    r = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{b}\n--- exit {r.returncode}\n--- stdout\n{r.stdout[-3000:]}\n--- stderr\n{r.stderr[-3000:]}"
    return r


def the(needle: str) -> Block:
    found = matching(BLOCKS, needle)
    assert len(found) == 1, f"{len(found)} README blocks contain {needle!r}"
    return found[0]


# needle → what its output must show (beyond exit 0)
RUN = {
    "pb.FinishReason.Name(chunk.finish_reason)": r"FINISH_REASON_(STOP|LENGTH)",
    "from openai import OpenAI": r"^stop \{'name': .*\}$",
    "@bn.function": r"^(weather|arithmetic|small talk) ",
    "@sgl.function": r"^(calculator|search engine) ",  # SGLang's frontend on the native API (docs/native-api.md)
    '"stream": true, "stream_options"': r"data: \[DONE\]",
    """-d '{"prompt": "Hello", "max_tokens": 16}'""": r'"object":"text_completion"',
    "banyan check-env": r"(?s)ready to serve.*^banyan top .*^group +running",
    "banyan bench --dataset shared-prefix": r"(?s)Successful requests +32\b.*Successful requests +16\b",
    "stub.OpenSession(": r"(?s)^prompt \d+ cached (\d+)\n.*^closed, it held [1-9]\d* tokens$",
    "localhost:8000/v1/sessions": r'"object":"session.deleted","deleted":true',
}
HANDLED = {"pip install torch==2.13.0 -e . && banyan serve", "grpcurl -plaintext", "--otlp-endpoint localhost:4317",
           "--api-key my-secret-key", "hf download Qwen/Qwen3-0.6B"}
HUB_ID = "banyan-test/tiny-qwen3"  # the own-model block's hub id, served from a local cache built here


def test_every_block_is_run_somewhere() -> None:
    assert len(BLOCKS) >= 10
    unhandled = [str(b) for b in BLOCKS if not docker_block(b)
                 and not any(n in b.text for n in (*ELSEWHERE, *RUN, *HANDLED))]
    assert not unhandled, f"README blocks no test runs: {unhandled}"
    for needle in (*ELSEWHERE, *RUN, *HANDLED):
        the(needle)  # each names exactly one block (a stale needle fails here)


def test_ci_runs_the_readme_test_command() -> None:
    cmd = the("python3 -m pytest -q").text.strip()
    assert cmd in (ROOT / ".ci" / "run").read_text()


def test_serve_is_the_command_the_server_runs(server) -> None:
    """`pip install … && banyan serve`: the install is CI's own; `banyan serve` is what
    tests.support.Server runs (plus its loopback ports and ready file); it serves."""
    install, serve = the("-e . && banyan serve").text.strip().split(" && ")
    assert install == "python3 -m pip install torch==2.13.0 -e ." and serve == "banyan serve"
    assert Path(server.log_path).with_suffix(".ready").exists()


@pytest.mark.parametrize("needle", list(RUN))
def test_block_runs(needle, server, env, tmp_path) -> None:
    r = run_block(the(needle), server, env, tmp_path)
    assert re.search(RUN[needle], r.stdout, re.M), r.stdout[-3000:]


def test_grpcurl_request_through_reflection(server) -> None:
    """The grpcurl block's request, resolved through server reflection as grpcurl resolves it."""
    from google.protobuf import descriptor_pool, json_format, message_factory
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    args = shlex.split(the("grpcurl -plaintext").text.replace("\\\n", " "))
    assert args[:2] == ["grpcurl", "-plaintext"] and args[2] == "-d"
    body, target, method = args[3], args[4], args[5]
    assert target == "localhost:50051"
    service, name = method.split("/")
    with grpc.insecure_channel(server.target) as ch:
        pool = descriptor_pool.DescriptorPool(ProtoReflectionDescriptorDatabase(ch))
        m = pool.FindServiceByName(service).FindMethodByName(name)
        req_cls = message_factory.GetMessageClass(m.input_type)
        resp_cls = message_factory.GetMessageClass(m.output_type)
        req = json_format.Parse(body, req_cls())
        call = ch.unary_stream(f"/{service}/{name}", request_serializer=req_cls.SerializeToString,
                               response_deserializer=resp_cls.FromString)
        chunks = [json_format.MessageToDict(c) for c in call(req, timeout=60)]
    assert chunks and chunks[-1]["finishReason"] in ("FINISH_REASON_LENGTH", "FINISH_REASON_STOP"), chunks[-1:]
    assert int(chunks[-1]["usage"]["completionTokens"]) <= 32


def test_otlp_serve_commands_start(env, tmp_path) -> None:
    """Each `banyan serve --otlp-endpoint …` line serves (no collector listens: export failures
    must not stop it) and stops cleanly; the two start side by side (half the wall time)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    lines = [ln for ln in the("--otlp-endpoint localhost:4317").text.splitlines() if ln.strip()]
    assert len(lines) == 2
    procs = []
    try:
        for i, line in enumerate(lines):
            cmd = line.split("&&")[-1].split("#")[0].strip()  # the install part: CI's (the otel extra is in test)
            assert "banyan serve --otlp-endpoint" in cmd
            ready = tmp_path / f"otel-{i}.ready"
            procs.append((cmd, ready, subprocess.Popen(
                ["bash", "-c", f"exec env {cmd} --ready-file {ready}"], cwd=tmp_path, env=env,
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)))
        deadline = time.monotonic() + 240
        for cmd, ready, p in procs:
            while not ready.exists():
                assert p.poll() is None, f"{cmd} exited {p.returncode}: {p.stderr.read()[-3000:]}"
                assert time.monotonic() < deadline, f"{cmd} not serving after 240 s"
                time.sleep(0.2)
            with grpc.insecure_channel(f"127.0.0.1:{int(ready.read_text().split()[0])}") as ch:
                status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=30).status
            assert status == health_pb2.HealthCheckResponse.SERVING, cmd
    finally:
        for _, _, p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        codes = [(cmd, p.wait(timeout=60)) for cmd, _, p in procs]
    assert all(code == 0 for _, code in codes), codes


def test_docker_blocks_are_the_deploy_tiers() -> None:
    """The Docker blocks run in tests/deploy/test_readme_docker.py (they need a Docker engine)."""
    docker = [b for b in BLOCKS if docker_block(b)]
    assert len(docker) >= 3
    text = (ROOT / "tests" / "deploy" / "test_readme_docker.py").read_text()
    assert "readme_blocks" in text and all(d in text for d in DOCKER)


def run_serving_block(b: Block, env: dict, tmp: Path, swap: dict[str, str] | None = None,
                      timeout: float = 300) -> subprocess.CompletedProcess:
    """A block that starts its own `banyan serve` (in the background) and stops it: run with free
    ports of its own in place of 50051 / 8000 (through the environment, as every flag is a
    variable), its process group killed if it overruns."""
    grpc_port, http_port = free_port(), free_port()
    text = b.text.replace("localhost:8000", f"127.0.0.1:{http_port}").replace("/tmp/banyan.ready",
                                                                               str(tmp / "banyan.ready"))
    for k, v in (swap or {}).items():
        text = text.replace(k, v)
    env = {**env, "BANYAN_GRPC_PORT": str(grpc_port), "BANYAN_HTTP_PORT": str(http_port)}
    p = subprocess.Popen(["bash", "-c", "set -e -o pipefail\n" + text], cwd=tmp, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        raise AssertionError(f"{b}: still running after {timeout:.0f} s\n{out[-3000:]}\n{err[-3000:]}") from None
    assert p.returncode == 0, f"{b}\n--- exit {p.returncode}\n--- stdout\n{out[-3000:]}\n--- stderr\n{err[-3000:]}"
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def test_quick_start_loopback_with_a_key(env, tmp_path) -> None:
    """The quick start's own server: on loopback, a request without the key is 401, one with it
    lists the model; `kill %1 && wait %1` is a clean stop (exit code 0) that takes the ready file."""
    b = the("--api-key my-secret-key")
    assert b.section == "Quick start" and "--host 127.0.0.1" in b.text
    r = run_serving_block(b, {**env, "BANYAN_HOST": "0.0.0.0"}, tmp_path)  # (the block's --host is what binds it)
    assert re.search(r"^401$", r.stdout, re.M) and '"id":"banyan-demo"' in r.stdout, r.stdout[-3000:]
    assert not (tmp_path / "banyan.ready").exists()


@pytest.fixture(scope="module")
def hub_cache(demo_dir, tmp_path_factory) -> Path:
    """A Hugging Face cache holding one snapshot, of a tiny Qwen3 model (with the demo tokenizer), as
    `hf download` leaves it."""
    cache = tmp_path_factory.mktemp("hf-cache")
    repo = cache / f"models--{HUB_ID.replace('/', '--')}"
    rev = "0" * 40
    make_tiny_model("qwen3", repo / "snapshots" / rev, demo_dir)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(rev)
    return cache


def test_own_model_block_serves_a_hub_id(env, tmp_path, hub_cache) -> None:
    """"Serve your own model" as written, on a cached hub id: `hf download` (offline here: the
    snapshot is in the cache, so it only resolves it), `banyan serve --model ID` found in the cache,
    a chat completion naming the model by its id, a clean stop."""
    b = the("hf download Qwen/Qwen3-0.6B")
    assert b.section == "Serve your own model"
    r = run_serving_block(b, {**env, "HF_HUB_CACHE": str(hub_cache), "HF_HUB_OFFLINE": "1"}, tmp_path,
                          swap={"Qwen/Qwen3-0.6B": HUB_ID})
    body = json.loads(r.stdout[r.stdout.index('{"id"'):].splitlines()[0])
    assert body["object"] == "chat.completion" and body["model"] == HUB_ID and body["usage"]["completion_tokens"] > 0
    assert not (tmp_path / "banyan.ready").exists()
