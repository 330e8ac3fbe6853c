"""Validation of the sampling extensions beyond the basic knobs (shared by every API front through
``validation.sampling``): prompt log-probs from a start position with alternatives. Each check
names the field in the front's spelling (``prefix``) and returns ``SamplingParams`` fields."""

from __future__ import annotations

from typing import TYPE_CHECKING

from shared.errors import InvalidArgument

if TYPE_CHECKING:
    from services.tokenizer.validation import SamplingRequest

MAX_PROMPT_TOP_LOGPROBS = 20


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise InvalidArgument(msg)


def prompt_logprob_fields(s: SamplingRequest, input_len: int, context: int, prefix: str) -> dict:
    """``prompt_logprobs_start`` (a position in the request's own input; a session turn's input
    follows ``context`` session tokens) → the engine's absolute ``prompt_logprobs_from``; and the
    alternatives per position."""
    top = 0 if s.prompt_top_logprobs is None else s.prompt_top_logprobs
    _require(0 <= top <= MAX_PROMPT_TOP_LOGPROBS,
             f"{prefix}prompt_top_logprobs must be in [0, {MAX_PROMPT_TOP_LOGPROBS}], got {top}")
    if s.prompt_logprobs_start is None:
        _require(top == 0, f"{prefix}prompt_top_logprobs needs prompt_logprobs_start (the first prompt position)")
        return {}
    start = s.prompt_logprobs_start
    _require(start >= 0, f"{prefix}prompt_logprobs_start must be >= 0 (0: from the first prompt token), got {start}")
    if input_len:  # (0: not tokenized yet — precheck)
        _require(start < input_len, f"{prefix}prompt_logprobs_start={start} is past the prompt's last token "
                                    f"(the prompt has {input_len} tokens)")
    return dict(prompt_logprobs_from=context + start, prompt_top_logprobs=top)
