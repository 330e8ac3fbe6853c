"""What a step costs, learned from the worker's step times, and the prompt tokens a step may carry
under ``--step-time-target-ms`` (issue 18's online goal: a new prompt must not stall every running
request's next token for a whole prompt's worth of GEMMs).

A step's device time is modelled as ``base + per_row × decode rows + per_token × prompt tokens
+ prompt_step × (1 if it carries prompt tokens)`` (the GEMMs and the attention of a step grow with its rows
and tokens; the suite measures ~23 µs a prompt token and ~30–70 µs a decode row on the H200 for the 8B
shape; a step with prompt tokens is not a decode graph's replay: its own fixed cost). The four coefficients
are fitted online by recursive least squares with forgetting (recent steps weigh more: the running
requests' contexts grow, the machine warms), starting from a weak prior, from every step the worker
answers (``StepOutput.busy_ms``: the step's device time, first input copy to last output).

With a target T, a step in which requests decode gets at most
``(T − base − prompt_step − per_row × rows) ÷ per_token`` prompt tokens, but never fewer than
``MIN_PROMPT_TOKENS`` (prompts always progress) nor than the prompt tokens waiting ÷ ``DRAIN_STEPS`` (the
queue is admitted within about that many steps whatever the target: when prompts arrive faster than the
target lets steps take them, the steps grow instead of the queue — on the H200, W5 at 4 req/s with a target
of 12 ms, the first floor alone and no fixed term queued requests for seconds: small chunks' steps, dearer
than the three-term model said, taught it a per-token cost too high to let more in). Never more than
``--max-prefill-tokens``; a step with nothing decoding is not limited (no one's inter-token latency is at
stake, and the first token comes sooner).
"""

from __future__ import annotations

import numpy as np

MIN_PROMPT_TOKENS = 64  # a step's prompt tokens under the target at least (progress when decodes alone reach it)
DRAIN_STEPS = 8  # ... and at least the prompt tokens waiting ÷ this (the queue cannot grow without bound)
PRIOR = (2.0, 0.05, 0.03, 0.0)  # ms: base, per decode row, per prompt token, a step with prompt tokens (weak)
PRIOR_VAR = (100.0, 1.0, 1.0, 100.0)
FORGET = 0.995  # weight of a step n steps old: FORGET^n (~200 steps' memory)
MAX_VAR = 1e4  # covariance bound: directions the recent steps do not excite (no prompts lately) stay tame


class StepModel:
    def __init__(self, drain_steps: int = DRAIN_STEPS) -> None:
        self.drain_steps = drain_steps
        self.theta = np.array(PRIOR, dtype=np.float64)
        self.cov = np.diag(np.array(PRIOR_VAR, dtype=np.float64))

    @property
    def base_ms(self) -> float:
        return float(max(self.theta[0], 0.0))

    @property
    def row_ms(self) -> float:
        return float(max(self.theta[1], 0.0))

    @property
    def token_ms(self) -> float:
        return float(max(self.theta[2], 1e-5))

    @property
    def prompt_step_ms(self) -> float:
        return float(max(self.theta[3], 0.0))

    def predict(self, rows: int, tokens: int) -> float:
        return self.base_ms + self.row_ms * rows + self.token_ms * tokens + (self.prompt_step_ms if tokens else 0.0)

    def observe(self, rows: int, tokens: int, ms: float) -> None:
        """One answered step: ``rows`` decode rows, ``tokens`` prompt tokens, ``ms`` of device time."""
        if not ms > 0 or not np.isfinite(ms):
            return  # (a worker that does not report it)
        x = np.array((1.0, float(rows), float(tokens), 1.0 if tokens else 0.0))
        px = self.cov @ x
        gain = px / (FORGET + x @ px)
        self.theta += gain * (ms - x @ self.theta)
        self.cov = (self.cov - np.outer(gain, px)) / FORGET
        if np.trace(self.cov) > MAX_VAR:
            self.cov *= MAX_VAR / np.trace(self.cov)

    def prompt_budget(self, target_ms: float, rows: int, cap: int, backlog: int = 0) -> int:
        """Prompt tokens a step with ``rows`` decode rows may add within ``target_ms`` (at most ``cap``), with
        ``backlog`` prompt tokens waiting (the floors: the module's docstring)."""
        room = (target_ms - self.base_ms - self.prompt_step_ms - self.row_ms * rows) / self.token_ms
        return int(min(cap, max(MIN_PROMPT_TOKENS, room, -(-backlog // self.drain_steps))))
