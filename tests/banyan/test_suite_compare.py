"""``benchmarks/gpu/suite_compare.py``: two trees' suite JSONs (as gpu.sh's cmp steps write them) → one table, the
change signed so that + is better, W1–W4 flagged against the 2 % the issue allows."""

from __future__ import annotations

import json

from benchmarks.gpu import suite_compare


def _write(folder, w1, w2, w3, w4, cold, cached) -> None:
    folder.mkdir()
    (folder / "suite_w12_cold.json").write_text(json.dumps({
        "meta": {"device": "NVIDIA H100 80GB HBM3"},
        "results": {"W1": {"ms_per_token": w1}, "W2": {"output_throughput": w2}},
        "startup_s": {"main": {"load": 3.0, "tune_small_m": 20.0, "ready": cold}}}))
    (folder / "suite_w1_cached.json").write_text(json.dumps({"startup_s": {"main": {"ready": cached}}}))
    (folder / "suite_w34.json").write_text(json.dumps({"results": {
        "W3": {"cache_on": {"output_throughput": w3}},
        "W4": {"constrained": {"output_throughput": w4}, "unconstrained": {"output_throughput": w4 * 1.1}}}}))


def test_the_table_signs_changes_so_that_plus_is_better_and_flags_the_2_percent(tmp_path, capsys) -> None:
    _write(tmp_path / "before", 4.24, 5970.0, 15000.0, 3000.0, 93.0, 30.0)
    _write(tmp_path / "after", 4.20, 5800.0, 15100.0, 2990.0, 40.0, 15.0)
    assert suite_compare.main([str(tmp_path / "before"), str(tmp_path / "after"), "--out", str(tmp_path / "t.md")]) == 0
    rows = {line.split(" | ")[0].lstrip("| "): line for line in capsys.readouterr().out.splitlines()}
    assert "+1.0 %" in rows["W1 batch-1 decode, ms/token"] and "within 2 %" in rows["W1 batch-1 decode, ms/token"]
    assert "-2.8 %" in rows["W2 output tok/s"] and "slower than 2 %" in rows["W2 output tok/s"]
    assert "within 2 %" in rows["W4 output tok/s, constrained"]  # (−0.3 %)
    cold = rows["start-up to ready, s: cold (nothing cached)"]
    assert "93.00" in cold and "40.00" in cold and "+132.5 %" in cold and "within" not in cold  # (not held to 2 %)
    assert "NVIDIA H100" in (tmp_path / "t.md").read_text()


def test_a_missing_run_leaves_its_rows_empty(tmp_path) -> None:
    _write(tmp_path / "before", 4.24, 5970.0, 15000.0, 3000.0, 93.0, 30.0)
    (tmp_path / "after").mkdir()
    text = suite_compare.table(tmp_path / "before", tmp_path / "after")
    assert "| W2 output tok/s | 5,970 |  |  |  |" in text
