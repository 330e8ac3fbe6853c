"""The tokenizer-replica benchmark runs end to end (tiny load) and counts every token once; with
probes, every probe gets its one token and a TTFT."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.support import ROOT


def test_bench_tokenizer_tiny(tmp_path, demo_dir):
    out = tmp_path / "r.json"
    r = subprocess.run([sys.executable, "-m", "benchmarks.bench_tokenizer", "--streams", "4", "--tokens", "10",
                        "--step-ms", "5", "--model", demo_dir, "--out", str(out), "--probe-rate", "50",
                        "--stream-interval", "3"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    (run,) = json.loads(out.read_text())["runs"]
    assert run["tokens"] == 40 and 4 <= run["messages"] <= 16 and run["delivered_tok_s"] > 0  # (sent at 1, 4, 7, 10)
    assert "delivered" in r.stdout and "probes (" in r.stdout
    probe = run["probe"]  # (probes until the background is done: at least one, each answered with its token)
    assert probe["n"] >= 1 and 0 < probe["ttft_p50_ms"] <= probe["ttft_max_ms"]
    assert set(run["replica_loop_lag"]) == {"windows", "p99_ms", "max_ms"}  # (its event_loop_lag lines)
