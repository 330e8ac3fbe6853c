"""Validate a public ``GenerateRequest`` once, at the edge, into internal types.

Every rejection is an ``InvalidArgument`` whose message names the field and the rule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from shared.errors import InvalidArgument
from shared.messages.common import SamplingParams
from shared.messages.to_tokenizer import ModelInfo
from shared.proto.banyan.v1 import generation_pb2 as pb
from services.tokenizer.text import Message, TextProcessor

MAX_REQUEST_ID = 256
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
MAX_SEED = 2**63 - 1
MAX_N = 64
MAX_CACHE_SALT = 256


@dataclass(frozen=True)
class Prepared:
    input_ids: list[int]
    params: SamplingParams
    stop: list[str]
    skip_special_tokens: bool
    n: int
    cache_ns: str


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise InvalidArgument(msg)


def _finite(name: str, v: float) -> None:
    _require(math.isfinite(v), f"sampling_params.{name} must be a finite number, got {v}")


def _check_vocab(field: str, ids: list[int], vocab_size: int) -> None:
    bad = next((t for t in ids if t >= vocab_size), None)
    if bad is not None:
        raise InvalidArgument(f"{field}: {bad} is out of the vocabulary [0, {vocab_size})")


def chat_messages(chat: pb.ChatInput) -> list[Message]:
    _require(len(chat.messages) > 0, "chat.messages must not be empty")
    for i, m in enumerate(chat.messages):
        _require(bool(m.role), f"chat.messages[{i}].role must not be empty")
    return [Message(m.role, m.content) for m in chat.messages]


def input_ids(req: pb.GenerateRequest, text: TextProcessor, info: ModelInfo) -> list[int]:
    kind = req.WhichOneof("input")
    if kind == "text":
        _require(len(req.text) > 0, "text must not be empty")
        ids = text.encode(req.text)
    elif kind == "token_ids":
        ids = list(req.token_ids.ids)
        _check_vocab("token_ids.ids", ids, info.vocab_size)
    elif kind == "chat":
        add = req.chat.add_generation_prompt if req.chat.HasField("add_generation_prompt") else True
        ids = text.encode_chat(chat_messages(req.chat), add)
    else:
        raise InvalidArgument("one of text, token_ids or chat is required")
    _require(len(ids) > 0, "the prompt has no tokens")
    _require(len(ids) < info.context_length,
             f"the prompt has {len(ids)} tokens; the context window is {info.context_length} "
             f"(at most {info.context_length - 1} prompt tokens)")
    return ids


def sampling(sp: pb.SamplingParams, prompt_len: int, info: ModelInfo) -> tuple[SamplingParams, list[str], bool]:
    room = info.context_length - prompt_len
    if sp.HasField("max_tokens"):
        _require(sp.max_tokens >= 1, "sampling_params.max_tokens must be >= 1")
        _require(sp.max_tokens <= room,
                 f"sampling_params.max_tokens={sp.max_tokens} with a {prompt_len}-token prompt exceeds the "
                 f"context window of {info.context_length} (at most {room})")
        max_new = sp.max_tokens
    else:
        max_new = room
    temperature = sp.temperature if sp.HasField("temperature") else 1.0
    top_p = sp.top_p if sp.HasField("top_p") else 1.0
    top_k = sp.top_k if sp.HasField("top_k") else -1
    min_p = sp.min_p if sp.HasField("min_p") else 0.0
    for name, v in (("temperature", temperature), ("top_p", top_p), ("min_p", min_p)):
        _finite(name, v)
    _require(temperature >= 0, f"sampling_params.temperature must be >= 0, got {temperature}")
    _require(0 < top_p <= 1, f"sampling_params.top_p must be in (0, 1], got {top_p}")
    _require(top_k >= -1, f"sampling_params.top_k must be -1 (off), 0 (off) or >= 1, got {top_k}")
    _require(0 <= min_p <= 1, f"sampling_params.min_p must be in [0, 1], got {min_p}")
    if sp.HasField("seed"):
        _require(sp.seed <= MAX_SEED, f"sampling_params.seed must be <= {MAX_SEED}")
    stop = list(sp.stop)
    _require(len(stop) <= MAX_STOP_STRINGS, f"sampling_params.stop has {len(stop)} strings (at most {MAX_STOP_STRINGS})")
    for s in stop:
        _require(0 < len(s) <= MAX_STOP_CHARS, f"sampling_params.stop strings must have 1..{MAX_STOP_CHARS} characters")
    stop_ids = list(sp.stop_token_ids)
    _require(len(stop_ids) <= MAX_STOP_TOKEN_IDS, f"sampling_params.stop_token_ids: at most {MAX_STOP_TOKEN_IDS}")
    _check_vocab("sampling_params.stop_token_ids", stop_ids, info.vocab_size)
    if not sp.ignore_eos:
        stop_ids += [t for t in info.eos_token_ids if t not in stop_ids]
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=-1 if top_k == 0 else top_k, min_p=min_p,
                            seed=sp.seed if sp.HasField("seed") else None, max_new_tokens=max_new,
                            stop_token_ids=stop_ids, ignore_eos=sp.ignore_eos)
    skip = sp.skip_special_tokens if sp.HasField("skip_special_tokens") else True
    return params, stop, skip


def prepare(req: pb.GenerateRequest, text: TextProcessor, info: ModelInfo) -> Prepared:
    _require(len(req.request_id) <= MAX_REQUEST_ID, f"request_id is longer than {MAX_REQUEST_ID} characters")
    _require(len(req.cache_salt) <= MAX_CACHE_SALT, f"cache_salt is longer than {MAX_CACHE_SALT} characters")
    sp = req.sampling_params
    n = sp.n if sp.HasField("n") else 1
    limit = min(MAX_N, info.max_running_requests)
    _require(1 <= n <= limit, f"sampling_params.n must be in [1, {limit}], got {n}")
    ids = input_ids(req, text, info)
    params, stop, skip = sampling(sp, len(ids), info)
    return Prepared(ids, params, stop, skip, n, req.cache_salt)
