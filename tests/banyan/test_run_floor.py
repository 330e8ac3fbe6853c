"""``benchmarks.gpu.run_floor``: an offline run's device time against the floor its own best step rates set —
runs split at host gaps, the full-batch decode rate and the large-chunk prompt rate read from the steps, the
floor and the rates a goal would need."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from benchmarks.gpu.run_floor import floor, load_runs, table

ROW_US, TOKEN_US, BASE_MS = 60.0, 20.0, 4.0


def step(i: int, kind: str, rows: int, prompt: int, recv: float, extra_ms: float = 0.0) -> dict:
    ms = BASE_MS * (kind.startswith("decode") and rows < 100) + (rows * ROW_US + prompt * TOKEN_US) / 1e3 + extra_ms
    return {"step": i, "kind": kind, "rows": rows, "tokens": rows + prompt, "recv": recv, "queued": recv + 1,
            "answered": recv + ms, "device_ms": ms, "idle_ms": 0.0}


def trace() -> list[dict]:
    """A warm-up run, then the run: two large chunks, full-batch decodes, a tail of small batches (each
    paying a per-step cost the full-batch steps do not)."""
    out, t = [step(0, "decode_graph", 1, 0, 0.0)], 1000.0
    plan = [("mixed", 10, 16000), ("mixed", 200, 16000)] + [("decode_piecewise", 200, 0)] * 6 + \
        [("mixed", 199, 3000)] * 2 + [("decode_graph", 50, 0)] * 4
    for i, (kind, rows, prompt) in enumerate(plan, start=1):
        s = step(i, kind, rows, prompt, t)
        out.append(s)
        t = s["answered"] + 1.0
    return out


def write(path: Path, steps: list[dict]) -> Path:
    with gzip.open(path, "wt") as f:
        f.writelines(json.dumps(s) + "\n" for s in reversed(steps))  # (order restored by step id)
    return path


def test_runs_split_at_host_gaps(tmp_path: Path) -> None:
    runs = load_runs(write(tmp_path / "steps.jsonl.gz", trace()), gap_ms=300.0)
    assert [len(r) for r in runs] == [1, 14]
    assert [s["step"] for s in runs[1]][:3] == [1, 2, 3]


def test_rates_and_floor_come_from_the_runs_best_steps(tmp_path: Path) -> None:
    run = load_runs(write(tmp_path / "steps.jsonl.gz", trace()), 300.0)[1]
    res = floor(run, chunk=8192, goal=None)
    assert res["full_batch_rows"] == 200 and res["full_batch_steps"] == 6
    assert res["decode_row_us"] == pytest.approx(ROW_US)
    assert res["large_chunk_steps"] == 2 and res["prompt_token_us"] == pytest.approx(TOKEN_US)
    assert res["prompt_tokens"] == 2 * 16000 + 2 * 3000
    rows = 10 + 200 + 6 * 200 + 2 * 199 + 4 * 50
    assert res["decode_rows"] == rows
    assert res["floor_s"] == pytest.approx((38000 * TOKEN_US + rows * ROW_US) / 1e6)
    assert res["device_s"] - res["floor_s"] == pytest.approx(4 * BASE_MS / 1e3)  # the tail's per-step cost
    assert res["fit"]["base_ms"] > 0 and res["fit"]["prompt_token_us"] == pytest.approx(TOKEN_US, rel=0.05)


def test_goal_scale_and_table(tmp_path: Path) -> None:
    run = load_runs(write(tmp_path / "steps.jsonl.gz", trace()), 300.0)[1]
    res = floor(run, chunk=8192, goal=None)
    goal = res["decode_rows"] / (res["floor_s"] * 0.9)  # a goal 10 % under the floor's time
    res = floor(run, chunk=8192, goal=goal)
    assert res["goal_rates_scale"] == pytest.approx(0.9)
    text = table(res)
    assert text.startswith("| | |") and "× (at the floor, no per-step cost) | " in text and "0.900" in text


def test_a_run_without_large_chunks_is_refused(tmp_path: Path) -> None:
    run = load_runs(write(tmp_path / "steps.jsonl.gz", trace()), 300.0)[1]
    with pytest.raises(SystemExit, match="--chunk"):
        floor(run, chunk=100_000, goal=None)
