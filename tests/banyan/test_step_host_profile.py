"""The mixed-step host profile (benchmarks/gpu/step_host_profile.py; measured on the H200) runs through the real
runner on the CPU: a decode-only step and a prompt chunk beside decodes each, their kinds, times and the
functions cProfile saw queueing them."""

from __future__ import annotations

import json

from benchmarks.gpu import step_host_profile
from tests.support import make_tiny_model


def test_the_host_profile_runs_on_the_cpu(demo_dir, tmp_path) -> None:
    model = make_tiny_model("llama", tmp_path / "m", demo_dir, seed=3)
    out = tmp_path / "host.json"
    assert step_host_profile.main(["--model", str(model), "--device", "cpu", "--decode-rows", "2",
                                   "--decode-context", "40", "--chunks", "24", "--steps", "2", "--top", "40",
                                   "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["chunk"], r["kind"]) for r in rows] == [(0, "decode_eager"), (24, "mixed")]  # (no graphs on the CPU)
    for r in rows:
        assert 0 < r["host_ms"] <= min(r["wall_ms"], r["host_ms_max"]) and r["device_ms"] > 0
        assert any("forward" in f["function"] for f in r["top"])  # (the model's forward, queued in launch)


def test_the_lanes_ab_runs_on_the_cpu(demo_dir, tmp_path, monkeypatch) -> None:
    """``--lanes``: each case as two lanes and whole, on one runner (split_step.py's knobs on)."""
    monkeypatch.setenv("BANYAN_SPLIT_MIXED", "16")
    monkeypatch.setenv("BANYAN_SPLIT_MIN_DECODES", "17")
    monkeypatch.setenv("BANYAN_SPLIT_DECODE", "34")
    model = make_tiny_model("llama", tmp_path / "m", demo_dir, seed=3)
    out = tmp_path / "lanes.json"
    assert step_host_profile.main(["--model", str(model), "--device", "cpu", "--decode-rows", "36",
                                   "--decode-context", "20", "--chunks", "24", "--steps", "2", "--top", "0",
                                   "--lanes", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["chunk"], r["lanes"], r["kind"]) for r in rows] == [
        (0, False, "decode_eager"), (0, True, "decode_split"), (24, False, "mixed"), (24, True, "mixed_split")]
    assert all(r["device_ms"] > 0 and not r["top"] for r in rows)
