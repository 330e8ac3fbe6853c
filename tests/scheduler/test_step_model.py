"""``--step-time-target-ms``: the step-time model fitted online (``step_model.py``) and the prompt
budget it gives the batcher — long prompts spread over steps while requests decode, whole when
nothing decodes, always progressing; the flag checked at start-up."""

from __future__ import annotations

from collections import deque

import numpy as np
import pytest

from services.scheduler.batcher import Batcher, Limits
from services.scheduler.kv import KVManager
from services.scheduler.policy import POLICIES
from services.scheduler.step_model import DRAIN_STEPS, MIN_PROMPT_TOKENS, StepModel
from shared.config import ConfigError, SchedulerConfig
from tests.scheduler.test_scheduler_units import req, step


def steps(model: StepModel, n: int, base: float, row: float, token: float, seed: int = 0, fixed: float = 0.0,
          chunks: tuple[int, int] = (16, 8000)) -> None:
    """``n`` answered steps of a worker whose steps cost base + row × rows + token × tokens (+ ``fixed`` when
    there are tokens; ±2 % noise): decode-only steps mostly, a prompt chunk in every fourth."""
    rng = np.random.default_rng(seed)
    for i in range(n):
        rows = int(rng.integers(1, 300))
        tokens = int(rng.integers(*chunks)) if i % 4 == 0 else 0
        cost = base + row * rows + token * tokens + (fixed if tokens else 0.0)
        model.observe(rows, tokens, cost * rng.uniform(0.98, 1.02))


def test_the_model_finds_the_costs_and_follows_a_change() -> None:
    m = StepModel()
    steps(m, 400, base=3.0, row=0.04, token=0.025)
    assert m.base_ms == pytest.approx(3.0, rel=0.15)
    assert m.row_ms == pytest.approx(0.04, rel=0.1) and m.token_ms == pytest.approx(0.025, rel=0.05)
    assert m.predict(100, 1000) == pytest.approx(3.0 + 4.0 + 25.0, rel=0.05)
    steps(m, 1500, base=3.0, row=0.04, token=0.05, seed=1)  # the prompts got dearer (longer contexts, say)
    assert m.token_ms == pytest.approx(0.05, rel=0.05)
    m.observe(10, 10, 0.0)  # a worker that reports no device time: ignored
    m.observe(10, 10, float("nan"))
    assert m.token_ms == pytest.approx(0.05, rel=0.05) and np.isfinite(m.theta).all()


def test_the_budget_fills_the_target_and_has_floors_and_a_cap() -> None:
    m = StepModel()
    steps(m, 400, base=3.0, row=0.04, token=0.025)
    assert m.prompt_budget(15.0, 100, 16384) == pytest.approx((15.0 - 3.0 - 4.0) / 0.025, rel=0.08)  # ~320
    assert m.prompt_budget(5.0, 200, 16384) == MIN_PROMPT_TOKENS  # decodes alone take longer: still progress
    assert m.prompt_budget(5.0, 200, 16384, backlog=8000) == 8000 // DRAIN_STEPS  # a queue: drained in ~8 steps
    assert m.prompt_budget(15.0, 100, 16384, backlog=800) == m.prompt_budget(15.0, 100, 16384)  # (the target's)
    assert m.prompt_budget(1000.0, 10, 2048) == 2048 and m.prompt_budget(5.0, 200, 2048, backlog=10**6) == 2048


def test_a_fixed_cost_of_prompt_steps_is_its_own_term() -> None:
    """Steps with prompt tokens cost 8 ms more than their tokens (not a decode graph's replay; on the H200 the
    worker's host queues such a step slower): fitted as such, not as a dearer token, so the budget of a
    feasible target stays what the target allows. Chunks mostly near one size (a budget's), some remainders."""
    m = StepModel()
    steps(m, 600, base=3.0, row=0.04, token=0.02, fixed=8.0, chunks=(64, 600))
    assert m.prompt_step_ms == pytest.approx(8.0, rel=0.1) and m.token_ms == pytest.approx(0.02, rel=0.1)
    assert m.predict(10, 0) == pytest.approx(3.4, rel=0.1)  # (a decode step: no fixed part)
    assert m.prompt_budget(20.0, 100, 16384) == pytest.approx((20.0 - 3.0 - 8.0 - 4.0) / 0.02, rel=0.15)  # ~250
    three = StepModel()  # without the term the same steps would say ~0.04 ms a token: half the budget
    three.theta[3], three.cov[3, 3] = 0.0, 0.0
    steps(three, 600, base=3.0, row=0.04, token=0.02, fixed=8.0, chunks=(64, 600))
    assert three.prompt_step_ms < 1.0 and three.token_ms > 0.03


def decoders() -> list:
    return [req(range(3000 + 40 * i, 3030 + 40 * i), max_new=64, rid=f"d{i}") for i in range(20)]  # (distinct)


def batcher(target: float) -> Batcher:
    b = Batcher(KVManager(8192, 64), POLICIES["fcfs"](), Limits(64, 4096, 4096, step_target_ms=target))
    b.step_model.theta[:] = (2.0, 0.1, 0.02, 0.0)  # (as if fitted: 2 ms + 0.1 ms a decode row + 0.02 ms a prompt token)
    return b


def test_a_long_prompt_is_spread_over_steps_while_others_decode() -> None:
    b = batcher(target=10.0)
    running, waiting = [], deque(decoders())
    s = step(b, running, waiting)  # nothing decodes yet: the 20 prompts go whole in one step
    assert s.prefill_tokens == 600 and len(running) == 20
    waiting.append(req(range(100, 2100), max_new=8, rid="long"))
    budget = int((10.0 - 2.0 - 0.1 * 20) / 0.02)  # 300 prompt tokens beside 20 decodes
    chunks = []
    while waiting or any(r.rid == "long" and r.to_compute > 1 for r in running):
        s = step(b, running, waiting)
        assert s.num_tokens - s.prefill_tokens == 20  # every decoding request got its token each step
        chunks.append(s.prefill_tokens)
    assert chunks == [budget] * (2000 // budget) + [2000 % budget]  # all of it, no step over the budget

    b = batcher(target=0.0)  # off: the prompt goes in one step
    running, waiting = [], deque(decoders())
    step(b, running, waiting)
    waiting.append(req(range(100, 2100), max_new=8, rid="long"))
    assert step(b, running, waiting).prefill_tokens == 2000


def test_decodes_beyond_the_target_still_let_prompts_progress() -> None:
    b = batcher(target=3.0)  # 20 decode rows alone are predicted at 4 ms
    running, waiting = [], deque(decoders())
    step(b, running, waiting)
    waiting.append(req(range(100, 400), max_new=8, rid="long"))
    assert step(b, running, waiting).prefill_tokens == MIN_PROMPT_TOKENS


def test_a_queue_the_target_cannot_take_is_drained_by_larger_steps() -> None:
    """Prompts waiting beyond what the target lets a step take: each step carries at least an eighth of the
    prompt tokens waiting, so a queue of 4 × 1,000 tokens is admitted with ~8 steps' worth of floor, not in
    63 steps of 64 (the steps grow instead of the queue)."""
    b = batcher(target=3.0)  # 20 decode rows alone are predicted at 4 ms: 64 a step by the target
    running, waiting = [], deque(decoders())
    step(b, running, waiting)
    waiting.extend(req(range(5000 + 1000 * i, 6000 + 1000 * i), max_new=2, rid=f"q{i}") for i in range(4))
    first = step(b, running, waiting)
    assert first.prefill_tokens == 4000 // DRAIN_STEPS and b.last_prompt_budget == 500
    taken, n = first.prefill_tokens, 1
    while taken < 4000:
        s = step(b, running, waiting)
        assert s.num_tokens - s.prefill_tokens >= 20  # (the decoders still get their token every step)
        taken, n = taken + s.prefill_tokens, n + 1
    assert taken == 4000 and n <= 25, n  # (the floor shrinks with the queue: 500, 438, 383, ... then 64s)
    assert b.counters.retractions == 0  # (no memory pressure in the way: the floor alone)


def test_the_flag_is_checked() -> None:
    assert SchedulerConfig(step_time_target_ms=12.5).step_time_target_ms == 12.5
    with pytest.raises(ConfigError, match="step_time_target_ms"):
        SchedulerConfig(step_time_target_ms=-1)
