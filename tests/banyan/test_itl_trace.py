"""``benchmarks.gpu.itl_trace``: a request's inter-token gaps lined up with the worker's step trace —
each gap ends with the last step answered inside it, a step answered inside it before that is one
the request sat out, and the slow gaps are counted by that step's kind and prompt tokens."""

from __future__ import annotations

from benchmarks.gpu.itl_trace import attribute, gaps, report

STEPS = [{"step": i, "kind": k, "rows": r, "tokens": t, "device_ms": d, "t": at} for i, (k, r, t, d, at) in enumerate([
    ("decode_graph", 10, 10, 5.0, 100.000), ("mixed_piecewise", 10, 522, 20.0, 100.020),
    ("decode_graph", 10, 10, 5.0, 100.025), ("prefill", 1, 512, 15.0, 100.040), ("decode_graph", 10, 10, 5.0, 100.046)])]
EPOCHS = [[100.0005, 100.0205, 100.0255, 100.0465]]  # a token 0.5 ms after each step it was in


def test_gaps_end_with_the_last_step_answered_inside_them() -> None:
    assert gaps(EPOCHS) == [(100.0005, 100.0205), (100.0205, 100.0255), (100.0255, 100.0465)]
    assert gaps([[1.0, 1.0, 2.0]]) == [(1.0, 2.0)]  # (two tokens of one message: one gap)
    ts = [s["t"] for s in STEPS]
    assert [s["step"] for s in attribute((100.0005, 100.0205), STEPS, ts)] == [1]
    assert [s["step"] for s in attribute((100.0255, 100.0465), STEPS, ts)] == [3, 4]  # step 3 sat out
    assert [s["step"] for s in attribute((100.0206, 100.0207), STEPS, ts)] == [1]  # (none inside: the last before)


def test_report_counts_the_slow_gaps_by_step() -> None:
    out = report(EPOCHS, STEPS, 10.0, 5)
    assert out.startswith("3 gaps of 1 requests: p50 20.0") and "over 10.0 ms: 2 (66.7%)" in out
    assert "| mixed_piecewise | 1 |" in out and "| decode_graph (+ steps sat out) | 1 |" in out
    assert "| ≤ 0 | 1 |" in out and "| ≤ 512 | 1 |" in out
    assert out.index("gap 21.0 ms") < out.index("gap 20.0 ms")  # slowest first
    assert "step 3 prefill rows 1 tokens 512 device 15.0 ms, answered +14.5 ms into the gap" in out
    assert report([], STEPS, 10.0, 5) == "no gaps or no steps to line up"
