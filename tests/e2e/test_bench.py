"""``banyan bench`` runs end to end against a live demo server and writes JSON + PNG."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support import ROOT, Server


@pytest.fixture(scope="module")
def server(demo_dir, tmp_path_factory):
    s = Server(None, tmp_path_factory.mktemp("bench") / "server.log")
    yield s
    assert s.stop() == 0, s.log_text()[-3000:]


@pytest.mark.parametrize("dataset,extra", [
    ("random", ["--num-prompts", "12", "--input-len", "8:48", "--output-len", "4:12", "--connections", "3",
                "--stream-interval", "3"]),
    ("shared-prefix", ["--groups", "2", "--prompts-per-group", "4", "--system-prompt-len", "64",
                       "--question-len", "8", "--output-len", "6"]),
])
def test_bench_grpc(server, tmp_path, dataset, extra):
    out = tmp_path / f"{dataset}.json"
    r = subprocess.run([sys.executable, "-m", "banyan.cli", "bench", "--target", server.target, "--dataset", dataset,
                        "--request-rate", "50", "--max-concurrency", "4", "--no-progress", "--out", str(out), *extra],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(out.read_text())
    n = 12 if dataset == "random" else 8
    assert res["completed"] == n and res["failed"] == 0
    assert res["total_output_tokens"] > 0 and res["output_throughput"] > 0 and res["ttft_ms"]["p50"] > 0
    assert "Output throughput" in r.stdout
    assert out.with_suffix(".png").stat().st_size > 1000
    if dataset == "shared-prefix":
        assert res["cached_tokens"] > 0  # later prompts of a group reuse its system prompt


def test_bench_openai_asks_the_vocabulary_over_http(server, tmp_path):
    """--backend openai on the demo model (a 2,000-token vocabulary): the token-id range and the
    model name come from /v1/models; progress counts output tokens; without matplotlib no PNG and
    a line saying how to get one."""
    no_mpl = tmp_path / "no-matplotlib"
    (no_mpl / "matplotlib").mkdir(parents=True)
    (no_mpl / "matplotlib" / "__init__.py").write_text("raise ImportError('hidden by the test')\n")
    out = tmp_path / "openai.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(no_mpl), str(ROOT)])}
    r = subprocess.run([sys.executable, "-m", "banyan.cli", "bench", "--backend", "openai", "--target",
                        server.http_url, "--num-prompts", "6", "--input-len", "8:32", "--output-len", "4:8",
                        "--max-concurrency", "3", "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(out.read_text())
    assert res["completed"] == 6 and res["failed"] == 0, res["errors"]
    assert res["config"]["model"] == "banyan-demo"
    assert "output tokens" in r.stderr and "tok" in r.stderr and "6/6 requests" in r.stderr, r.stderr[-2000:]
    assert not out.with_suffix(".png").exists()
    assert "no plots: matplotlib is not installed" in r.stdout


def test_bench_openai_says_when_the_server_hides_its_vocabulary(tmp_path):
    """A server whose /v1/models has no vocab_size (not Banyan): one line asking for --vocab-size."""
    import http.server
    import threading

    class Models(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            body = json.dumps({"object": "list", "data": [{"id": "other", "object": "model"}]}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    srv = http.server.HTTPServer(("127.0.0.1", 0), Models)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        r = subprocess.run([sys.executable, "-m", "banyan.cli", "bench", "--backend", "openai", "--target",
                            f"http://127.0.0.1:{srv.server_port}", "--num-prompts", "2", "--out",
                            str(tmp_path / "x.json")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    finally:
        srv.shutdown()
    assert r.returncode != 0
    assert "does not report its vocabulary size" in r.stderr and "--vocab-size" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_grpc_backend_spreads_requests_over_its_connections():
    """``--connections N``: N channels, each of its own subchannel pool (a TCP connection of its own,
    which the kernel gives to one tokenizer replica), taken round robin."""
    from banyan.bench.backends import GrpcBackend

    b = GrpcBackend("127.0.0.1:1", connections=3)  # (channels connect lazily: nothing is dialed here)
    assert len(b.channels) == 3 and len({id(c) for c in b.channels}) == 3
    assert [id(b.stub) for _ in range(6)] == [id(s) for s in b._stubs[1:] + b._stubs[:1]] * 2
    with pytest.raises(ValueError):
        GrpcBackend("127.0.0.1:1", connections=0)


def test_multiturn_hit_rate_never_exceeds_its_optimum(server, tmp_path):
    """Two identical multi-turn runs (same seed: the same system prompt, users and greedy answers):
    the second finds nothing of the first in the cache (each run is salted), and neither reports a hit
    rate above the optimum beside it."""
    for k in range(2):
        out = tmp_path / f"multiturn-{k}.json"
        r = subprocess.run([sys.executable, "-m", "banyan.cli", "bench", "--target", server.target, "--dataset",
                            "multiturn", "--conversations", "4", "--turns", "3", "--system-prompt-len", "64",
                            "--user-len", "16", "--output-len", "4", "--max-concurrency", "2", "--no-progress",
                            "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
        res = json.loads(out.read_text())
        assert res["completed"] == 12 and 0 < res["cache_hit_rate"] <= res["optimum_hit_rate"] < 1, res


def test_bench_writes_a_new_file_each_run(server, tmp_path):
    """Without --out the results go to a timestamped name: a second run never overwrites the first."""
    args = [sys.executable, "-m", "banyan.cli", "bench", "--target", server.target, "--num-prompts", "2",
            "--input-len", "8", "--output-len", "2", "--no-progress"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for _ in range(2):
        r = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
        assert r.returncode == 0, r.stdout + r.stderr
    made = sorted(p.name for p in tmp_path.glob("bench-*.json"))
    assert len(made) == 2 and all(json.loads((tmp_path / m).read_text())["completed"] == 2 for m in made), made
