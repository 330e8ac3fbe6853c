"""The step-time target in simulation (benchmarks/sim_step_target.py: the real Batcher and StepModel, a cost-model
worker, a simulated clock): where a step with prompt tokens costs only its tokens, the target bounds every
inter-token gap; where it costs a fixed 8 ms more, the target cannot be met and the queue floor is what keeps
the queue and the first tokens bounded (without it: a queue of dozens and seconds to a first token)."""

from __future__ import annotations

import json

from benchmarks import sim_step_target


def run(tmp_path, *args: str) -> dict:
    out = tmp_path / "sim.json"
    assert sim_step_target.main([*args, "--out", str(out)]) == 0
    return json.loads(out.read_text())["results"]


def test_without_a_fixed_cost_the_target_bounds_the_gaps(tmp_path) -> None:
    r = run(tmp_path, "--requests", "40", "--rate", "4", "--fixed", "0", "--target", "12")
    assert r["off"]["itl_p99"] > 20  # a whole prompt's step stalls everyone decoding
    assert r["target"]["itl_p99"] <= 12.0 + 1e-6 and r["target"]["itl_p50"] == r["off"]["itl_p50"]
    assert r["target"]["ttft_p50"] > r["off"]["ttft_p50"]  # (the price: first tokens later)


def test_when_the_target_cannot_be_met_the_queue_floor_bounds_the_queue(tmp_path) -> None:
    r = run(tmp_path, "--requests", "60", "--rate", "8", "--fixed", "8", "--target", "12")
    floor, none = r["target"], r["target, no queue floor"]
    assert none["longest_queue"] >= 20 and none["ttft_p50"] > 2000  # 64-token steps cannot keep up with arrivals
    assert floor["longest_queue"] <= 5 and floor["ttft_p50"] < 400
    assert floor["duration_s"] < 1.1 * r["off"]["duration_s"]  # (no throughput lost to the target)
