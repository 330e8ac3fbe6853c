"""``banyan bench`` runs end to end against a live demo server and writes JSON + PNG."""

from __future__ import annotations

import json
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
    ("random", ["--num-prompts", "12", "--input-len", "8:48", "--output-len", "4:12"]),
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
