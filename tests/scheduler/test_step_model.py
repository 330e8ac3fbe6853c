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
from services.scheduler.step_model import MIN_PROMPT_TOKENS, StepModel
from shared.config import ConfigError, SchedulerConfig
from tests.scheduler.test_scheduler_units import req, step


def steps(model: StepModel, n: int, base: float, row: float, token: float, seed: int = 0) -> None:
    """``n`` answered steps of a worker whose steps cost base + row × rows + token × tokens (±2 % noise):
    decode-only steps mostly, a prompt chunk in every fourth."""
    rng = np.random.default_rng(seed)
    for i in range(n):
        rows = int(rng.integers(1, 300))
        tokens = int(rng.integers(16, 8000)) if i % 4 == 0 else 0
        model.observe(rows, tokens, (base + row * rows + token * tokens) * rng.uniform(0.98, 1.02))


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


def test_the_budget_fills_the_target_and_has_a_floor_and_a_cap() -> None:
    m = StepModel()
    steps(m, 400, base=3.0, row=0.04, token=0.025)
    assert m.prompt_budget(15.0, 100, 16384) == pytest.approx((15.0 - 3.0 - 4.0) / 0.025, rel=0.08)  # ~320
    assert m.prompt_budget(5.0, 200, 16384) == MIN_PROMPT_TOKENS  # decodes alone take longer: still progress
    assert m.prompt_budget(1000.0, 10, 2048) == 2048


def decoders() -> list:
    return [req(range(3000 + 40 * i, 3030 + 40 * i), max_new=64, rid=f"d{i}") for i in range(20)]  # (distinct)


def batcher(target: float) -> Batcher:
    b = Batcher(KVManager(8192, 64), POLICIES["fcfs"](), Limits(64, 4096, 4096, step_target_ms=target))
    b.step_model.theta[:] = (2.0, 0.1, 0.02)  # (as if fitted: 2 ms + 0.1 ms a decode row + 0.02 ms a prompt token)
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


def test_the_flag_is_checked() -> None:
    assert SchedulerConfig(step_time_target_ms=12.5).step_time_target_ms == 12.5
    with pytest.raises(ConfigError, match="step_time_target_ms"):
        SchedulerConfig(step_time_target_ms=-1)
