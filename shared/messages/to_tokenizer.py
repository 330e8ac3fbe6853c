"""Messages a tokenizer replica receives from the scheduler."""

from __future__ import annotations

import msgspec

from shared.messages.common import ErrorCode, FinishReason


class ModelInfo(msgspec.Struct, tag="info", frozen=True):
    """Sent in answer to ``TokenizerHello`` once the worker is ready, and to every replica again
    when a restarted worker is ready (serving again)."""

    model: str
    architecture: str
    vocab_size: int
    context_length: int
    pool_size: int
    max_running_requests: int
    eos_token_ids: list[int]
    device: str
    dtype: str


class TokenOut(msgspec.Struct, frozen=True, omit_defaults=True):
    """New tokens of one request since the last output; ``finish`` set on the last one."""

    rid: str
    index: int = 0  # branch of an n > 1 request
    token_ids: list[int] = []
    finish: FinishReason | None = None  # set on the branch's last output
    error: str = ""  # message when finish is ERROR
    error_code: ErrorCode | None = None  # set when finish is ERROR
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    logprobs: list[float] = []  # per token in token_ids, when asked for
    top_ids: list[list[int]] = []  # per token: the most likely alternatives
    top_logprobs: list[list[float]] = []
    prompt_logprobs: list[float] = []  # scoring: logprobs of prompt tokens from prompt_logprobs_from on


class TokenOutBatch(msgspec.Struct, tag="outs", frozen=True):
    """All outputs for one replica from one scheduler step."""

    outs: list[TokenOut]


class Load(msgspec.Struct, tag="load", frozen=True):
    """The scheduler's load, in answer to ``LoadReq``."""

    token: str
    num_running: int
    num_waiting: int
    kv_free: int
    kv_used: int
    kv_pool: int
    kv_evictable: int  # cached, unlocked: reclaimable on demand
    steps: int
    prefill_computed_tokens: int  # prompt tokens the model computed
    prefill_cached_tokens: int  # prompt tokens whose KV was reused from the cache
    decode_tokens: int
    retractions: int
    evicted_tokens: int
    jump_forward_tokens: int = 0  # structured output: tokens appended without sampling
    # hierarchical cache (0 without it): prompt tokens whose KV came back from the host / disk tier (part of
    # prefill_cached_tokens); the tiers' size and use (per rank); tokens copied each way; failed copies
    host_cached_tokens: int = 0
    disk_cached_tokens: int = 0
    host_pool_tokens: int = 0
    host_used_tokens: int = 0
    disk_capacity_bytes: int = 0
    disk_used_bytes: int = 0
    tier_stored_tokens: int = 0  # device → host
    tier_loaded_tokens: int = 0  # host → device
    disk_written_tokens: int = 0
    disk_read_tokens: int = 0
    tier_failures: int = 0


class EngineStatus(msgspec.Struct, tag="status", frozen=True):
    """The engine stopped serving (its worker was lost: every request in flight was failed first)
    and why; a ``ModelInfo`` sent again later means it serves again (a restarted worker is ready)."""

    serving: bool
    reason: str = ""


ToTokenizer = ModelInfo | TokenOutBatch | Load | EngineStatus
