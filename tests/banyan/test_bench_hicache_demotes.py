"""The host-tier demote benchmark runs end to end (a few requests on a tiny pool): every request done,
the tier's traffic and demotes read from the scheduler's metrics, a table printed and JSON written."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.support import ROOT


def test_bench_hicache_demotes_tiny(tmp_path):
    out = tmp_path / "r.json"
    r = subprocess.run([sys.executable, "-m", "benchmarks.bench_hicache_demotes", "--requests", "16", "--pool", "1500",
                        "--out", str(out), "--work", str(tmp_path / "w")],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["completed"] == 16 and doc["failed"] == 0 and doc["load"]["evicted_tokens"] > 0
    assert doc["tier"]["moved_bytes|device_to_host"] > 0 and "demoted_tokens" in doc["tier"]
    assert "tokens demoted" in r.stdout
