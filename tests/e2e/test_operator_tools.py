"""`banyan check-env` and `banyan top --once` against a live `banyan serve` (the demo model)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from shared.proto.banyan.v1 import generation_pb2 as pb
from tests.support import ROOT, Server, free_port

REQUESTS = 5


@pytest.fixture(scope="module")
def server(demo_dir, tmp_path_factory):
    s = Server(None, tmp_path_factory.mktemp("operator") / "server.log")
    yield s
    assert s.stop() == 0, s.log_text()[-3000:]


def banyan(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "banyan.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def test_check_env_passes_on_free_ports_and_fails_on_the_servers(server) -> None:
    ok = banyan("check-env", "--host", "127.0.0.1", "--grpc-port", str(free_port()), "--http-port", str(free_port()))
    assert ok.returncode == 0, ok.stdout + ok.stderr
    rows = {line.split()[0]: line for line in ok.stdout.splitlines() if line.strip()}
    for check in ("python", "torch", "xgrammar", "grpc", "model", "tokenizer"):
        assert " OK " in rows[check], rows[check]
    assert "banyan-demo" in rows["model"] and "chat template yes" in rows["tokenizer"]
    assert "ready to serve" in ok.stdout
    # the live server's ports: both taken, exit 1, the HTTP one recognised as a server answering /health
    busy = banyan("check-env", "--json", "--host", "127.0.0.1", "--grpc-port", str(server.port), "--http-port",
                  str(server.http_port))
    assert busy.returncode == 1, busy.stdout + busy.stderr
    report = json.loads(busy.stdout)
    by = {r["check"]: r for r in report["checks"]}
    assert report["ok"] is False
    assert by["port grpc"]["status"] == "fail" and str(server.port) in by["port grpc"]["detail"]
    assert by["port http"]["status"] == "fail" and "answering /health" in by["port http"]["detail"]
    assert [r["check"] for r in report["checks"] if r["status"] == "fail"] == ["port grpc", "port http"]


def test_check_env_fails_on_a_model_directory_that_does_not_load(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    r = banyan("check-env", "--model", str(tmp_path), "--grpc-port", "-1", "--http-port", "-1")
    assert r.returncode == 1
    model = next(line for line in r.stdout.splitlines() if line.startswith("model"))
    assert "FAIL" in model and "GPT2LMHeadModel" in model and "not supported" in model
    assert "NOT READY" in r.stdout


def test_top_once_shows_what_the_server_did(server, stub) -> None:
    for i in range(REQUESTS):
        req = pb.GenerateRequest(text=f"Top test {i}", sampling_params=pb.SamplingParams(max_tokens=6, ignore_eos=True))
        assert list(stub.Generate(req, timeout=60))[-1].finish_reason == pb.FINISH_REASON_LENGTH
    ready = server.log_path.with_suffix(".ready")

    def finished() -> float:  # what the tokenizers counted (they record a request as its stream closes)
        return sum(float(line.split()[-1]) for line in server.metrics("tokenizer").splitlines()
                   if line.startswith('banyan:request_success_total{finish_reason="length"}'))

    deadline = time.monotonic() + 30
    while finished() < REQUESTS:
        assert time.monotonic() < deadline, server.metrics("tokenizer")
        time.sleep(0.1)
    r = banyan("top", "--ready-file", str(ready), "--once", "--json", "--interval", "0.5")
    assert r.returncode == 0, r.stdout + r.stderr
    v = json.loads(r.stdout)
    tok = v["tokenizer"]
    # what top reads equals what the endpoint itself says
    assert tok["finished"]["length"] == finished() == REQUESTS
    assert tok["errors"]["since_start"] == 0 and tok["errors"]["http_5xx"] == 0
    assert tok["ttft_ms"]["since_start"]["p50"] > 0 and tok["itl_ms"]["since_start"]["p99"] > 0
    assert tok["requests_per_s"] == 0  # nothing finished between the two scrapes
    (group,) = v["groups"]
    assert group["errors"] == [] and group["running"] == 0 and group["waiting"] == 0
    assert 0 <= group["kv_usage"] <= 1 and group["kv_evictable_tokens"] > 0  # the prompts stay cached
    assert 0 <= group["cache_hit_rate"]["all"] <= 1 and group["forward_failures"] == 0
    assert group["step_ms"]["since_start"]["p50"] > 0
    # the text view: the same numbers, one table row per group
    t = banyan("top", "--ready-file", str(ready), "--once", "--interval", "0.2")
    assert t.returncode == 0, t.stderr
    assert "TTFT ms" in t.stdout and f"length {REQUESTS}" in t.stdout
    assert any(line.split()[:3] == ["0", "0", "0"] for line in t.stdout.splitlines()), t.stdout
    # given as URLs instead: each endpoint recognised by what it serves
    u = banyan("top", "--once", "--json", "--interval", "0.2", f"127.0.0.1:{server.worker_metrics_port}",
               f"http://127.0.0.1:{server.http_port}", f"127.0.0.1:{server.scheduler_metrics_port}")
    assert u.returncode == 0, u.stderr
    uv = json.loads(u.stdout)
    assert uv["tokenizer"]["url"].endswith(f":{server.http_port}/metrics")
    assert uv["groups"][0]["scheduler"].endswith(f":{server.scheduler_metrics_port}/metrics")


def test_top_says_what_it_cannot_reach(tmp_path) -> None:
    ready = tmp_path / "ready"
    ready.write_text(f"1\n{free_port()}\n0\n0\n")
    r = banyan("top", "--ready-file", str(ready), "--once", "--interval", "0.1")
    assert r.returncode == 1 and "UNREACHABLE" in r.stdout and "unreachable" in r.stderr
    missing = banyan("top", "--ready-file", str(tmp_path / "nope"), "--once")
    assert missing.returncode == 1 and "no ready file" in missing.stderr and "Traceback" not in missing.stderr
