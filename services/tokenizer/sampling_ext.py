"""Validation of the sampling extensions beyond the basic knobs (shared by every API front through
``validation.sampling``): prompt log-probs from a start position with alternatives, and the logit
processors (``logit_bias``, ``min_tokens``, ``repetition_penalty``). Each check names the field in
the front's spelling (``prefix``) and returns ``SamplingParams`` fields. See docs/sampling.md."""

from __future__ import annotations

import math
from typing import Protocol

from shared.errors import InvalidArgument


class SamplingRequest(Protocol):
    """The fields of ``validation.SamplingRequest`` these checks read (a Protocol, so this module
    does not import the one that imports it)."""

    prompt_logprobs_start: int | None
    prompt_top_logprobs: int | None
    logit_bias: dict[int, float] | None
    min_tokens: int | None
    repetition_penalty: float | None

MAX_PROMPT_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 1024  # entries
LOGIT_BIAS_LIMIT = 100.0  # biases are clamped to [-100, 100] (OpenAI's range)
MAX_REPETITION_PENALTY = 2.0


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


def processor_fields(s: SamplingRequest, vocab_size: int, max_new_tokens: int, prefix: str) -> dict:
    """``logit_bias`` (token id → bias, clamped to ±100), ``min_tokens`` (≤ max_tokens) and
    ``repetition_penalty`` (in (0, 2], 1 = off) → their ``SamplingParams`` fields (only those set)."""
    out: dict = {}
    bias = s.logit_bias or {}
    _require(len(bias) <= MAX_LOGIT_BIAS, f"{prefix}logit_bias has {len(bias)} entries (at most {MAX_LOGIT_BIAS})")
    clamped = {}
    for tok, value in bias.items():
        _require(isinstance(tok, int) and not isinstance(tok, bool),
                 f"{prefix}logit_bias: key {tok!r} is not a token id (the fronts parse JSON keys into ints)")
        _require(0 <= tok < vocab_size, f"{prefix}logit_bias: token id {tok} is out of the vocabulary [0, {vocab_size})")
        _require(isinstance(value, (int, float)) and math.isfinite(value),
                 f"{prefix}logit_bias[{tok}] must be a finite number, got {value!r}")
        value = min(LOGIT_BIAS_LIMIT, max(-LOGIT_BIAS_LIMIT, float(value)))
        if value:
            clamped[tok] = value
    if clamped:
        out["logit_bias"] = clamped
    if s.min_tokens is not None:
        _require(0 <= s.min_tokens <= max_new_tokens,
                 f"{prefix}min_tokens must be in [0, max_tokens={max_new_tokens}], got {s.min_tokens}")
        if s.min_tokens:
            out["min_new_tokens"] = s.min_tokens
    if s.repetition_penalty is not None:
        p = s.repetition_penalty
        _require(isinstance(p, (int, float)) and math.isfinite(p) and 0 < p <= MAX_REPETITION_PENALTY,
                 f"{prefix}repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}] (1 = off), got {p}")
        if p != 1.0:
            out["repetition_penalty"] = float(p)
    return out
