"""Smoke test of the container deployment: images, compose stack, two tokenizer replicas.

scripts/docker_ci.sh (the session's `docker_images` fixture, tests/deploy/conftest.py) installs
Debian's Docker engine and docker-compose when missing, starts dockerd (stopped at the session's
end when it started it), builds the debootstrap base image and the service images (a no-op when
all is there).
Then the CPU stack of compose.yaml comes up under its own project name with 2 tokenizer replicas
behind the front proxy (published on free loopback ports), and the test
  - waits for every container's health check,
  - sends gRPC (the Python stubs) and HTTP requests through the proxy and proves from each
    tokenizer container's logs that both replicas served both protocols,
  - follows one request_id through the tokenizer, scheduler and worker containers' stage logs,
and always takes the stack down (`down -v`). An engine that cannot be installed or started fails
the test with the script's output: it is never skipped.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
import urllib.request
import uuid
from collections import defaultdict
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shared.proto.banyan.v1 import generation_pb2 as pb, generation_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(2400)  # a cold machine installs the engine and builds the images first

ROOT = Path(__file__).resolve().parents[2]
PROJECT = "banyanci"  # fixed: a stack left by a killed run is taken down by the next one
REPLICAS = 2
SERVICES = ("scheduler", "worker", "tokenizer", "proxy")
HEALTH_TIMEOUT_S = 300.0
REQUESTS_PER_PROTOCOL = 4  # round robin over 2 replicas: 2 each


def run(cmd: list[str], timeout: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)


def explain(r: subprocess.CompletedProcess) -> str:
    return f"{r.args} exited {r.returncode}\n--- stdout\n{r.stdout[-6000:]}\n--- stderr\n{r.stderr[-6000:]}"


def docker() -> str:
    """Debian's CLI (matches its daemon; the script installs it), else whichever is on PATH."""
    return "/usr/bin/docker" if os.path.exists("/usr/bin/docker") else "docker"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Stack:
    """One compose project of the CPU stack, driven with Debian's docker-compose 1.29."""

    def __init__(self) -> None:
        self.grpc_port, self.http_port = free_port(), free_port()
        # The stack's own variables only: BANYAN_* settings of the CI environment stay out of it.
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("BANYAN_", "COMPOSE_"))}
        self.env.update(BANYAN_PUBLISH_HOST="127.0.0.1", BANYAN_PUBLISH_GRPC_PORT=str(self.grpc_port),
                        BANYAN_PUBLISH_HTTP_PORT=str(self.http_port), BANYAN_LOG_LEVEL="info")
        compose = shutil.which("docker-compose") or "/usr/bin/docker-compose"
        self.compose = [compose, "--ansi", "never", "-p", PROJECT, "-f", str(ROOT / "compose.yaml")]

    def __call__(self, *args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
        r = run([*self.compose, *args], timeout=timeout, env=self.env)
        if check:
            assert r.returncode == 0, explain(r)
        return r

    def containers(self) -> list[dict]:
        """docker inspect of every container of the project: [{service, name, status, health}]."""
        ids = run([docker(), "ps", "-aq", "--filter", f"label=com.docker.compose.project={PROJECT}"], 30)
        assert ids.returncode == 0, explain(ids)
        if not ids.stdout.split():
            return []
        r = run([docker(), "inspect", *ids.stdout.split()], 30)
        assert r.returncode == 0, explain(r)
        return [{"service": c["Config"]["Labels"].get("com.docker.compose.service"), "name": c["Name"].lstrip("/"),
                 "status": c["State"]["Status"], "health": (c["State"].get("Health") or {}).get("Status")}
                for c in json.loads(r.stdout)]

    def logs(self, service: str) -> dict[str, list[dict]]:
        """The JSON log lines of each container of ``service``: {container name: [line, ...]}."""
        r = self("logs", "--no-color", service, timeout=60)
        out: dict[str, list[dict]] = defaultdict(list)
        for line in r.stdout.splitlines():
            name, sep, text = line.partition("|")
            if not sep or not text.strip().startswith("{"):
                continue
            try:
                out[name.strip()].append(json.loads(text))
            except json.JSONDecodeError:
                continue
        return out

    def diagnostics(self) -> str:
        ps = self("ps", check=False, timeout=60)
        logs = self("logs", "--no-color", "--tail", "40", check=False, timeout=60)
        return f"--- ps\n{ps.stdout}{ps.stderr}\n--- logs (tail)\n{logs.stdout[-12000:]}{logs.stderr[-2000:]}"


@pytest.fixture(scope="module")
def timings() -> dict[str, float]:
    t: dict[str, float] = {}
    yield t
    print("\ncompose smoke timings (s): " + ", ".join(f"{k} {v:.1f}" for k, v in t.items()))


@pytest.fixture(scope="module")
def images(docker_images, timings) -> None:
    """The engine and images (the session fixture; its time is counted by the first module using it)."""


@pytest.fixture(scope="module")
def stack(images, timings) -> Stack:
    s = Stack()
    s("down", "-v", "--remove-orphans", "--timeout", "5", timeout=180)  # leftovers of a killed run
    try:
        t0 = time.monotonic()
        s("up", "-d", "--no-build", "--scale", f"tokenizer={REPLICAS}", timeout=300)
        wait_healthy(s)
        timings["up + healthy"] = time.monotonic() - t0
        yield s
    finally:
        t0 = time.monotonic()
        r = s("down", "-v", "--remove-orphans", "--timeout", "5", check=False, timeout=180)
        timings["down"] = time.monotonic() - t0
        assert r.returncode == 0, explain(r)


def wait_healthy(s: Stack) -> None:
    deadline = time.monotonic() + HEALTH_TIMEOUT_S
    while True:
        cs = s.containers()
        counts = {svc: sum(c["service"] == svc for c in cs) for svc in SERVICES}
        dead = [c for c in cs if c["status"] in ("exited", "dead") or c["health"] == "unhealthy"]
        assert not dead, f"containers died or are unhealthy: {dead}\n{s.diagnostics()}"
        if counts == {**dict.fromkeys(SERVICES, 1), "tokenizer": REPLICAS} and all(
                c["health"] == "healthy" for c in cs):
            break
        assert time.monotonic() < deadline, f"stack not healthy after {HEALTH_TIMEOUT_S:.0f} s: {cs}\n{s.diagnostics()}"
        time.sleep(1)
    # The proxy checks its replicas every 2 s on its own: wait until it sees all of them up.
    deadline = time.monotonic() + 30
    while (up := proxy_servers_up(s)) < REPLICAS:
        assert time.monotonic() < deadline, f"the proxy sees {up} tokenizer replicas up\n{s.diagnostics()}"
        time.sleep(0.5)


def proxy_servers_up(s: Stack) -> int:
    """How many tokenizer replicas the proxy's HTTP and gRPC backends both count as UP (its stats)."""
    r = s("exec", "-T", "proxy", "bash", "-c",
          "exec 3<>/dev/tcp/127.0.0.1/8404 && printf 'GET /stats;csv HTTP/1.0\\r\\n\\r\\n' >&3 && cat <&3",
          check=False, timeout=30)
    rows = [line.split(",") for line in r.stdout.splitlines() if line.startswith("tokenizer_")]
    up = defaultdict(int)
    for row in rows:
        if row[1].startswith("tokenizer") and row[17] == "UP":
            up[row[0]] += 1
    return min(up["tokenizer_grpc"], up["tokenizer_http"])


def http(url: str, body: dict | None = None, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=60) as r:
        return r.status, r.read()


def stages_by_container(s: Stack, service: str, rids: set[str]) -> dict[str, dict[str, list[dict]]]:
    """{container: {request_id: [stage lines]}} for the given request ids."""
    out: dict[str, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for name, lines in s.logs(service).items():
        for e in lines:
            if e.get("event") == "stage" and e.get("request_id") in rids:
                out[name][e["request_id"]].append(e)
    return out


def test_compose_stack_serves_through_both_replicas(stack: Stack, timings) -> None:
    tag = uuid.uuid4().hex[:8]
    t0 = time.monotonic()

    # gRPC through the proxy: health, then one channel whose calls the proxy spreads per RPC.
    with grpc.insecure_channel(f"127.0.0.1:{stack.grpc_port}") as ch:
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=30)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        stub = pb_grpc.GenerationServiceStub(ch)
        grpc_ids, texts = [], set()
        for i in range(REQUESTS_PER_PROTOCOL):
            rid = f"compose-grpc-{tag}-{i}"
            req = pb.GenerateRequest(request_id=rid, text="Once upon a time",
                                     sampling_params=pb.SamplingParams(max_tokens=8, temperature=0))
            chunks = list(stub.Generate(req, timeout=60))
            assert chunks and chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH, chunks[-1:]
            texts.add("".join(c.text for c in chunks))
            grpc_ids.append(rid)
        assert len(texts) == 1, f"greedy outputs differ between replicas: {texts}"

    # HTTP (OpenAI-compatible) through the proxy: plain and streaming.
    base = f"http://127.0.0.1:{stack.http_port}"
    assert http(base + "/health")[0] == 200
    http_ids = []
    for i in range(REQUESTS_PER_PROTOCOL):
        rid = f"compose-http-{tag}-{i}"
        body = {"model": "banyan-demo", "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 8,
                "temperature": 0, "stream": i % 2 == 1}
        status, data = http(base + "/v1/chat/completions", body, {"X-Request-Id": rid})
        assert status == 200, data[:500]
        if body["stream"]:
            assert data.rstrip().endswith(b"data: [DONE]"), data[-300:]
        else:
            assert json.loads(data)["choices"][0]["finish_reason"] == "length", data[:500]
        http_ids.append(rid)
    timings["requests"] = time.monotonic() - t0

    # Both replicas served both protocols: each tokenizer container logged `received` for some of each.
    all_ids = set(grpc_ids) | set(http_ids)
    deadline = time.monotonic() + 20  # docker's log capture is asynchronous
    while True:
        tok = stages_by_container(stack, "tokenizer", all_ids)
        served = {name: {rid for rid, lines in by_rid.items() if any(e["stage"] == "received" for e in lines)}
                  for name, by_rid in tok.items()}
        ok = len(served) == REPLICAS and all(ids & set(grpc_ids) and ids & set(http_ids) for ids in served.values())
        if ok and set().union(*served.values()) == all_ids:
            break
        assert time.monotonic() < deadline, f"requests per tokenizer replica: {served}\n{stack.diagnostics()}"
        time.sleep(1)

    # One request followed through every service's logs by its request_id (and one trace_id).
    rid = grpc_ids[0]
    want = {"tokenizer": {"received", "tokenized", "sent"}, "scheduler": {"queued", "scheduled", "finished"},
            "worker": {"worker_admitted"}}
    deadline = time.monotonic() + 20
    while True:
        seen: dict[str, list[dict]] = {}
        for service in want:
            lines = [e for by_rid in stages_by_container(stack, service, {rid}).values() for e in by_rid[rid]]
            seen[service] = lines
        missing = {svc: want[svc] - {e["stage"] for e in seen[svc]} for svc in want}
        if not any(missing.values()):
            break
        assert time.monotonic() < deadline, f"stages of {rid} missing from the logs: {missing}\n{stack.diagnostics()}"
        time.sleep(1)
    assert {e["service"] for svc in want for e in seen[svc]} == set(want)
    trace_ids = {e.get("trace_id") for svc in want for e in seen[svc]}
    assert len(trace_ids) == 1 and None not in trace_ids, trace_ids


@pytest.mark.parametrize("flavour", ["v1", "v2"])
def test_compose_variants_are_valid(composes, flavour) -> None:
    """compose.yaml, the GPU override and the monitoring and gateway profiles parse with Debian's docker-compose
    1.29 and with compose v2 (their images are not pulled: the CPU smoke test above is the one that
    runs); no `version` warning from v2."""
    argv, env = composes[flavour]
    base = {k: v for k, v in env.items() if not k.startswith(("BANYAN_", "COMPOSE_"))}
    compose = [*argv, "-p", PROJECT, "-f", str(ROOT / "compose.yaml")]
    r = run([*compose, "config", "-q"], timeout=60, env=base)
    assert r.returncode == 0 and "obsolete" not in r.stderr, explain(r)
    gpu = [*compose, "-f", str(ROOT / "compose.gpu.yaml"), "config"]
    r = run(gpu, timeout=60, env=base)
    assert r.returncode != 0 and "BANYAN_MODEL_DIR" in r.stderr, explain(r)  # the model is required
    r = run(gpu, timeout=60, env={**base, "BANYAN_MODEL_DIR": "/srv/models/some-model"})
    assert r.returncode == 0, explain(r)
    import yaml

    worker = yaml.safe_load(r.stdout)["services"]["worker"]
    (device,) = worker["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"] and device["device_ids"] == ["0"]
    assert worker["image"] == "banyan:gpu" and worker["build"]["dockerfile"] == "Dockerfile.gpu"
    assert worker["environment"]["BANYAN_MODEL"] == "/model"
    mounts = [v if isinstance(v, str) else f"{v['source']}:{v['target']}:{'ro' if v.get('read_only') else 'rw'}"
              for v in worker["volumes"]]
    assert "/srv/models/some-model:/model:ro" in mounts, mounts
    # the compiled kernels outlive the container, where the image's unprivileged user may write them
    # (and Banyan's: the CUDA decode linear nvcc builds, the start-up tunings' decisions)
    assert {m.split(":")[1] for m in mounts} >= {"/var/cache/flashinfer", "/var/cache/triton", "/var/cache/banyan"}, \
        mounts
    dockerfile = (ROOT / "Dockerfile.gpu").read_text()
    assert "TRITON_CACHE_DIR=/var/cache/triton" in dockerfile and \
        "chown banyan /var/cache/flashinfer /var/cache/triton /var/cache/banyan" in dockerfile
    assert "BANYAN_KERNEL_CACHE=/var/cache/banyan/kernels" in dockerfile and \
        "BANYAN_TUNING_CACHE=/var/cache/banyan/tuning" in dockerfile
    r = run([*compose, "--profile", "monitoring", "config", "--services"], timeout=60, env=base)
    assert r.returncode == 0, explain(r)
    assert {"prometheus", "grafana", "otel-collector"} <= set(r.stdout.split()), r.stdout
    r = run([*compose, "--profile", "gateway", "config", "--services"], timeout=60, env=base)
    assert r.returncode == 0, explain(r)
    assert {"gateway", "scheduler-b", "worker-b", "tokenizer-b"} <= set(r.stdout.split()), r.stdout
