"""Structs used on more than one channel, and helpers for raw int32 array fields."""

from __future__ import annotations

import enum

import msgspec
import numpy as np


class FinishReason(enum.StrEnum):
    """Why a request branch ended (the wire value is the lower-case name)."""

    STOP = "stop"  # a stop token or stop string, or the grammar ended
    LENGTH = "length"  # max_new_tokens, or the context window is full
    ABORT = "abort"  # cancelled: the client went away, an Abort call, a deadline, shutdown
    ERROR = "error"  # failed: TokenOut.error_code and .error say why


class ErrorCode(enum.StrEnum):
    """What kind of failure a ``FinishReason.ERROR`` is; each maps to one gRPC status code
    (``shared.errors.BY_WIRE_CODE``) and HTTP status."""

    INVALID_ARGUMENT = "invalid_argument"
    ALREADY_EXISTS = "already_exists"
    RESOURCE_EXHAUSTED = "resource_exhausted"
    UNAVAILABLE = "unavailable"
    INTERNAL = "internal"
    NOT_FOUND = "not_found"  # an unknown, closed or expired session; an unknown pin
    FAILED_PRECONDITION = "failed_precondition"  # e.g. a session turn that would exceed its capacity


class SamplingParams(msgspec.Struct, frozen=True, omit_defaults=True):
    """Validated sampling parameters (validation happens once, in the tokenizer)."""

    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 = off
    min_p: float = 0.0
    seed: int | None = None
    max_new_tokens: int = 128
    stop_token_ids: list[int] = []  # includes the model's EOS ids unless ignore_eos
    ignore_eos: bool = False
    presence_penalty: float = 0.0  # subtracted once from the logit of every token already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence of a token already generated
    logprobs: bool = False  # return the sampled token's log-probability
    top_logprobs: int = 0  # and this many most likely alternatives
    # Prompt log-probs: ≥ 0 returns the logprob of every prompt token from this position on (position 0,
    # the first token, has none: the values start at max(1, prompt_logprobs_from)); -1 = off. The prefix
    # cache still serves the positions before it. With prompt_top_logprobs > 0, that many alternatives each.
    prompt_logprobs_from: int = -1
    prompt_top_logprobs: int = 0
    stream_interval: int = 1  # the scheduler sends new tokens this many at a time (the first at once)
    # Logit processors (services/worker/sampling/processors.py), applied only to the rows that use them:
    logit_bias: dict[int, float] = {}  # token id → added to its logit (in [-100, 100])
    min_new_tokens: int = 0  # stop_token_ids (EOS included) cannot be sampled before this many new tokens
    repetition_penalty: float = 1.0  # HF: logits of prompt + output tokens divided (> 0) or multiplied (< 0) by it

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def processed(self) -> bool:
        """A logit processor applies (logit_bias, min_new_tokens or repetition_penalty)."""
        return bool(self.logit_bias) or self.min_new_tokens > 0 or self.repetition_penalty != 1.0

    @property
    def scores_prompt(self) -> bool:
        """Prompt log-probs were asked for."""
        return self.prompt_logprobs_from >= 0

    @property
    def first_scored(self) -> int:
        """The first prompt position with a logprob (its logits are those of the position before)."""
        return max(1, self.prompt_logprobs_from)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


class Constraint(msgspec.Struct, frozen=True, omit_defaults=True):
    """Structured-output constraint of a request (compiled by the scheduler)."""

    kind: str  # json_schema | json_object | regex | ebnf | choice | structural_tag (xgrammar's JSON)
    value: str = ""  # schema / regex / grammar text
    choices: list[str] = []


def i32(values) -> bytes:
    """Pack ints as a little-endian int32 raw buffer (one array frame inside a struct)."""
    return np.asarray(values, dtype="<i4").tobytes()


def from_i32(buf: bytes) -> np.ndarray:
    return np.frombuffer(buf, dtype="<i4")


def f32(values) -> bytes:
    return np.asarray(values, dtype="<f4").tobytes()


def from_f32(buf: bytes) -> np.ndarray:
    return np.frombuffer(buf, dtype="<f4")
