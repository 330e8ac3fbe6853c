"""Validate a generation request once, at the edge, into internal types.

The API fronts (gRPC, OpenAI HTTP) turn their messages into a ``Prompt`` and a ``SamplingRequest``
(``None`` = not given) and call ``prepare``. Every rejection is an ``InvalidArgument`` whose
message names the field (in the front's own spelling, via ``prefix``) and the rule.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field

import msgspec

from shared.errors import FailedPrecondition, InvalidArgument
from shared.messages.common import Constraint, SamplingParams
from shared.messages.to_scheduler import GenerateReq, SessionTurn
from shared.messages.to_tokenizer import ModelInfo, SessionView
from services.tokenizer.sampling_ext import processor_fields, prompt_logprob_fields
from services.tokenizer.text import ChatExtras, Message, TextProcessor

MAX_REQUEST_ID = 256
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
MAX_SEED = 2**64 - 1  # the proto's uint64
SEED_RANGE = 2**63  # the engine's seeds: [0, 2**63); larger ones are folded into it (top bit dropped)
MAX_N = 64
MAX_CACHE_SALT = 256
MIN_PRIORITY, MAX_PRIORITY = -1000, 1000
MAX_SESSION_ID = 256
MAX_TOP_LOGPROBS = 20
MAX_STREAM_INTERVAL = 1024  # tokens a streamed message may hold back
MAX_GRAMMAR_CHARS = 256 * 1024
MAX_CHOICES = 1024
# Text longer than this many characters per token of the context window cannot be a prompt; it is
# refused before tokenizing (tokenizing costs ~1 µs a character on the replica's event loop).
MAX_CHARS_PER_TOKEN = 64
SAMPLING_EPS = 1e-5  # temperatures below this are greedy (dividing logits by them overflows)
ROLE = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,63}")


@dataclass(frozen=True)
class Prompt:
    """Exactly one of text, token ids or chat messages."""

    text: str | None = None
    token_ids: list[int] | None = None
    messages: list[Message] | None = None
    add_generation_prompt: bool = True
    extras: ChatExtras | None = None  # chat messages: the tools and chat_template_kwargs for the template


@dataclass(frozen=True)
class SamplingRequest:
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    n: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    stream_interval: int | None = None
    # Prompt log-probs (sampling_ext.py): from this position of the prompt on (0 = the first token, whose
    # logprob is None; None = off), with this many alternatives per position (0..20).
    prompt_logprobs_start: int | None = None
    prompt_top_logprobs: int | None = None
    # Logit processors (sampling_ext.py; applied on the worker to the rows that use them):
    logit_bias: dict[int, float] | None = None  # token id → bias added to its logit, clamped to [-100, 100]
    min_tokens: int | None = None  # stop tokens (EOS included) are not sampled before this many new tokens
    repetition_penalty: float | None = None  # HF's, over prompt + output, in (0, 2]; 1 = off


@dataclass(frozen=True)
class Prepared:
    """A validated request: the message for the scheduler, whole (its ``rid`` and ``traceparent``
    are filled in when it is submitted), and what only the tokenizer needs to detokenize it."""

    req: GenerateReq
    stop: list[str]
    skip_special_tokens: bool
    context_tokens: int = 0  # a session turn: the session's tokens before ``req.input_ids``

    @property
    def prompt_tokens(self) -> int:
        """The whole prompt (a session turn's includes the session's tokens)."""
        return self.context_tokens + len(self.req.input_ids)


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise InvalidArgument(msg)


def _check_vocab(name: str, ids: list[int], vocab_size: int) -> None:
    bad = next((t for t in ids if t < 0 or t >= vocab_size), None)
    if bad is not None:
        raise InvalidArgument(f"{name}: {bad} is out of the vocabulary [0, {vocab_size})")


def check_messages(messages: list[Message], name: str = "messages") -> None:
    _require(len(messages) > 0, f"{name} must not be empty")
    for i, m in enumerate(messages):
        _require(bool(m.role), f"{name}[{i}].role must not be empty")
        _require(ROLE.fullmatch(m.role) is not None,
                 f"{name}[{i}].role {m.role[:80]!r} is not a role name (1-64 letters, digits, '_' or '-', "
                 "starting with a letter, e.g. system, user, assistant, tool)")


def max_text_chars(info: ModelInfo) -> int:
    return info.context_length * MAX_CHARS_PER_TOKEN


def check_text_size(chars: int, info: ModelInfo, what: str = "the prompt text") -> None:
    limit = max_text_chars(info)
    _require(chars <= limit, f"{what} has {chars} characters, more than any prompt that fits the context "
                             f"window of {info.context_length} tokens can have (at most {limit})")


def check_chat_size(messages: list[Message], info: ModelInfo) -> None:
    _require(len(messages) <= info.context_length,
             f"{len(messages)} chat messages cannot fit the context window of {info.context_length} tokens")
    check_text_size(sum(len(m.role) + len(m.content) for m in messages), info, "the chat messages")


def input_ids(prompt: Prompt, text: TextProcessor, info: ModelInfo) -> list[int]:
    if prompt.text is not None:
        _require(len(prompt.text) > 0, "the prompt text must not be empty")
        check_text_size(len(prompt.text), info)
        ids = text.encode(prompt.text)
    elif prompt.token_ids is not None:
        ids = list(prompt.token_ids)
        _check_vocab("token ids", ids, info.vocab_size)
    elif prompt.messages is not None:
        check_messages(prompt.messages)
        check_chat_size(prompt.messages, info)
        ids = text.encode_chat(prompt.messages, prompt.add_generation_prompt, prompt.extras)
    else:
        raise InvalidArgument("a prompt is required: text, token ids or chat messages")
    _require(len(ids) > 0, "the prompt has no tokens")
    _require(len(ids) < info.context_length,
             f"the prompt has {len(ids)} tokens; the context window is {info.context_length} "
             f"(at most {info.context_length - 1} prompt tokens)")
    return ids


def check_priority(priority: int, name: str = "priority") -> int:
    _require(MIN_PRIORITY <= priority <= MAX_PRIORITY,
             f"{name} must be an integer in [{MIN_PRIORITY}, {MAX_PRIORITY}] (higher = more urgent), got {priority}")
    return priority


def check_session_id(session_id: str, name: str = "session_id") -> str:
    _require(0 < len(session_id) <= MAX_SESSION_ID, f"{name} must have 1..{MAX_SESSION_ID} characters")
    return session_id


def session_input_ids(prompt: Prompt, text: TextProcessor, info: ModelInfo, session: SessionView) -> list[int]:
    """A session turn's new tokens. The first turn is tokenized like any prompt; later ones
    continue it: text without the tokenizer's special tokens (no second BOS), chat messages
    rendered as a continuation (the template applied to the new messages only), token ids as
    they are."""
    if session.length == 0 or prompt.token_ids is not None:
        return input_ids(prompt, text, info)
    if prompt.text is not None:
        _require(len(prompt.text) > 0, "the prompt text must not be empty")
        check_text_size(len(prompt.text), info)
        ids = text.encode(prompt.text, add_special_tokens=False)
    elif prompt.messages is not None:
        check_messages(prompt.messages)
        check_chat_size(prompt.messages, info)
        rendered = text.render_chat_continuation(prompt.messages, prompt.add_generation_prompt, prompt.extras)
        ids = text.encode(rendered, add_special_tokens=False)
    else:
        raise InvalidArgument("a prompt is required: text, token ids or chat messages")
    _require(len(ids) > 0, "the prompt has no tokens")
    return ids


def _session_limits(s: SamplingRequest, ids: list[int], info: ModelInfo, session: SessionView, prefix: str) -> int:
    """The most tokens the turn may generate (the session's capacity and the context window left),
    or FAILED_PRECONDITION when the session cannot take it."""
    sid, total = session.session_id, session.length + len(ids)
    if total >= info.context_length:
        raise FailedPrecondition(f"session {sid!r} holds {session.length} tokens on this turn's branch; with the "
                                 f"{len(ids)} new ones that fills the context window of {info.context_length}")
    room = min(info.context_length - total, session.capacity_left - len(ids))
    if room < (0 if s.max_tokens == 0 else 1):  # (a prefill-only turn needs no room for an answer)
        raise FailedPrecondition(f"session {sid!r} is full: {session.capacity_left} of its {session.capacity} tokens "
                                 f"are left and this turn's input has {len(ids)} (and needs room for an answer)")
    if s.max_tokens is not None and s.max_tokens > room:
        raise FailedPrecondition(f"{prefix}max_tokens={s.max_tokens} does not fit session {sid!r}: room for {room} more "
                                 f"tokens after this turn's {len(ids)}-token input ({session.capacity_left} of its "
                                 f"capacity {session.capacity} left, the context window {info.context_length})")
    return room


def sampling(s: SamplingRequest, prompt_len: int, info: ModelInfo, prefix: str, context: int = 0) -> SamplingParams:
    """``prompt_len``: the whole prompt's tokens, of which the first ``context`` are a session's."""
    room = info.context_length - prompt_len
    if s.max_tokens is not None:
        _require(s.max_tokens >= 0, f"{prefix}max_tokens must be >= 0 (0: prefill only, no new tokens)")
        _require(s.max_tokens <= room,
                 f"{prefix}max_tokens={s.max_tokens} with a {prompt_len}-token prompt exceeds the "
                 f"context window of {info.context_length} (at most {room})")
    temperature = 1.0 if s.temperature is None else s.temperature
    top_p = 1.0 if s.top_p is None else s.top_p
    top_k = -1 if s.top_k is None else s.top_k
    min_p = 0.0 if s.min_p is None else s.min_p
    for name, v in (("temperature", temperature), ("top_p", top_p), ("min_p", min_p)):
        _require(math.isfinite(v), f"{prefix}{name} must be a finite number, got {v}")
    _require(temperature >= 0, f"{prefix}temperature must be >= 0, got {temperature}")
    if temperature < SAMPLING_EPS:
        temperature = 0.0
    _require(0 < top_p <= 1, f"{prefix}top_p must be in (0, 1], got {top_p}")
    _require(top_k >= -1, f"{prefix}top_k must be -1 (off), 0 (off) or >= 1, got {top_k}")
    _require(0 <= min_p <= 1, f"{prefix}min_p must be in [0, 1], got {min_p}")
    presence = 0.0 if s.presence_penalty is None else s.presence_penalty
    frequency = 0.0 if s.frequency_penalty is None else s.frequency_penalty
    for name, v in (("presence_penalty", presence), ("frequency_penalty", frequency)):
        _require(math.isfinite(v) and -2 <= v <= 2, f"{prefix}{name} must be in [-2, 2], got {v}")
    top_logprobs = 0 if s.top_logprobs is None else s.top_logprobs
    _require(0 <= top_logprobs <= MAX_TOP_LOGPROBS, f"{prefix}top_logprobs must be in [0, {MAX_TOP_LOGPROBS}]")
    interval = 1 if s.stream_interval is None else s.stream_interval
    _require(1 <= interval <= MAX_STREAM_INTERVAL, f"{prefix}stream_interval must be in [1, {MAX_STREAM_INTERVAL}]")
    if s.seed is not None:
        _require(0 <= s.seed <= MAX_SEED, f"{prefix}seed must be in [0, {MAX_SEED}]")
    seed = None if s.seed is None else s.seed % SEED_RANGE  # 2**63 + k samples as k (branch i uses seed + i)
    _require(len(s.stop) <= MAX_STOP_STRINGS, f"{prefix}stop has {len(s.stop)} strings (at most {MAX_STOP_STRINGS})")
    for x in s.stop:
        _require(0 < len(x) <= MAX_STOP_CHARS, f"{prefix}stop strings must have 1..{MAX_STOP_CHARS} characters")
    stop_ids = list(s.stop_token_ids)
    _require(len(stop_ids) <= MAX_STOP_TOKEN_IDS, f"{prefix}stop_token_ids: at most {MAX_STOP_TOKEN_IDS}")
    _check_vocab(f"{prefix}stop_token_ids", stop_ids, info.vocab_size)
    if not s.ignore_eos:
        stop_ids += [t for t in info.eos_token_ids if t not in stop_ids]
    max_new = room if s.max_tokens is None else s.max_tokens
    return SamplingParams(temperature=temperature, top_p=top_p, top_k=-1 if top_k == 0 else top_k, min_p=min_p,
                          seed=seed, max_new_tokens=max_new,
                          stop_token_ids=stop_ids, ignore_eos=s.ignore_eos, presence_penalty=presence,
                          frequency_penalty=frequency, logprobs=s.logprobs or top_logprobs > 0,
                          top_logprobs=top_logprobs, stream_interval=interval,
                          **prompt_logprob_fields(s, prompt_len - context, context, prefix),
                          **processor_fields(s, info.vocab_size, max_new, prefix))


def check_constraint(c: Constraint | None) -> Constraint | None:
    """Shallow checks here; the scheduler's compiler has the last word."""
    if c is None:
        return None
    if c.kind == "choice":
        _require(0 < len(c.choices) <= MAX_CHOICES, f"choice needs 1..{MAX_CHOICES} strings")
        _require(all(c.choices), "choice strings must not be empty")
        _require(not any("\x00" in x for x in c.choices), "choice strings must not contain NUL characters")
        _require(sum(map(len, c.choices)) <= MAX_GRAMMAR_CHARS, "choice strings are too long in total")
        return c
    if c.kind == "json_object":
        return c
    _require(0 < len(c.value) <= MAX_GRAMMAR_CHARS, f"{c.kind} must have 1..{MAX_GRAMMAR_CHARS} characters")
    if c.kind == "json_schema":
        try:
            schema = json.loads(c.value)
        except json.JSONDecodeError as e:
            raise InvalidArgument(f"json_schema is not valid JSON: {e}") from None
        _require(isinstance(schema, (dict, bool)), "json_schema must be a JSON object (or true/false)")
    return c


def precheck(prompt: Prompt, s: SamplingRequest, info: ModelInfo, *, request_id: str = "", cache_salt: str = "",
             prefix: str = "", priority: int = 0) -> None:
    """What ``prepare`` checks that does not depend on a session, before a session turn's round trip
    to the scheduler: bad input is INVALID_ARGUMENT whatever the session."""
    _require(len(request_id) <= MAX_REQUEST_ID, f"request_id is longer than {MAX_REQUEST_ID} characters")
    _require(len(cache_salt) <= MAX_CACHE_SALT, f"cache_salt is longer than {MAX_CACHE_SALT} characters")
    check_priority(priority)
    if prompt.text is not None:
        _require(len(prompt.text) > 0, "the prompt text must not be empty")
        check_text_size(len(prompt.text), info)
    elif prompt.token_ids is not None:
        _require(len(prompt.token_ids) > 0, "the prompt has no tokens")
        _check_vocab("token ids", list(prompt.token_ids), info.vocab_size)
    elif prompt.messages is not None:
        check_messages(prompt.messages)
        check_chat_size(prompt.messages, info)
    else:
        raise InvalidArgument("a prompt is required: text, token ids or chat messages")
    sampling(s, 0, info, prefix)


def prepare(prompt: Prompt, s: SamplingRequest, text: TextProcessor, info: ModelInfo, *,
            request_id: str = "", cache_salt: str = "", prefix: str = "",
            constraint: Constraint | None = None, priority: int = 0,
            session: SessionView | None = None) -> Prepared:
    """``session``: continue that session (``sessions.SessionFront.view``): the prompt is its
    tokens followed by this input, which is all that goes down."""
    _require(len(request_id) <= MAX_REQUEST_ID, f"request_id is longer than {MAX_REQUEST_ID} characters")
    _require(len(cache_salt) <= MAX_CACHE_SALT, f"cache_salt is longer than {MAX_CACHE_SALT} characters")
    check_priority(priority)
    n = 1 if s.n is None else s.n
    limit = min(MAX_N, info.max_running_requests)
    _require(1 <= n <= limit, f"{prefix}n must be in [1, {limit}], got {n}")
    _require(n == 1 or s.max_tokens != 0, f"{prefix}n must be 1 with max_tokens 0 (a prefill-only request "
                                         "samples nothing)")
    turn, context = None, 0
    if session is None:
        ids = input_ids(prompt, text, info)
        params = sampling(s, len(ids), info, prefix)
    else:
        _require(n == 1, f"{prefix}n must be 1 with session_id (a session turn continues one conversation)")
        _require(cache_salt in ("", session.cache_ns), "cache_salt must be empty or the session's own with session_id")
        cache_salt, context = session.cache_ns, session.length
        ids = session_input_ids(prompt, text, info, session)
        room = _session_limits(s, ids, info, session, prefix)
        params = sampling(s, context + len(ids), info, prefix, context)
        params = msgspec.structs.replace(params, max_new_tokens=min(params.max_new_tokens, room))
        turn = SessionTurn(session.session_id, session.parent, session.length)
    req = GenerateReq(rid=request_id, input_ids=ids, params=params, n=n, cache_ns=cache_salt,
                      constraint=check_constraint(constraint), priority=priority, session=turn)
    return Prepared(req, list(s.stop), s.skip_special_tokens, context)
