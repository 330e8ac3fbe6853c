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
    # Prompt log-probs (SamplingParams.prompt_logprobs_from ≥ 0), on the branch's first output that carries
    # tokens (or its last): the logprob of each prompt token from position max(1, prompt_logprobs_from) on,
    # and, with prompt_top_logprobs, the most likely alternatives at each of those positions.
    prompt_logprobs: list[float] = []
    prompt_top_ids: list[list[int]] = []
    prompt_top_logprobs: list[list[float]] = []


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
    preemptions: int = 0  # running requests preempted by higher-priority ones (priority scheduling)
    shed: int = 0  # waiting requests dropped from a full queue for higher-priority ones
    num_sessions: int = 0  # sessions open
    session_tokens: int = 0  # tokens the sessions hold pinned
    num_pins: int = 0  # pinned prefixes (PinPrefix)
    pinned_tokens: int = 0  # tokens they hold pinned
    max_pinned_tokens: int = 0  # the cap on session + pinned tokens (--max-pinned-tokens)
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


class SessionView(msgspec.Struct, frozen=True):
    """A session as a new turn sees it (``SessionOp`` open / info)."""

    session_id: str
    parent: str  # the turn a new one continues ("": the session's start)
    length: int  # that turn's tokens
    capacity: int  # tokens the session may hold
    capacity_left: int  # what it may still add (minus what turns in flight may add)
    cache_ns: str
    ttl_s: float


class Reply(msgspec.Struct, tag="reply", frozen=True, omit_defaults=True):
    """The answer to ``SessionOp`` / ``UnpinReq`` (same token): an error, or what was asked."""

    token: str
    error_code: ErrorCode | None = None
    error: str = ""
    session: SessionView | None = None
    tokens: int = 0  # close / unpin: the tokens it held pinned


class EngineStatus(msgspec.Struct, tag="status", frozen=True):
    """The engine stopped serving (its worker was lost: every request in flight was failed first)
    and why; a ``ModelInfo`` sent again later means it serves again (a restarted worker is ready)."""

    serving: bool
    reason: str = ""


class KvStored(msgspec.Struct, tag="stored", frozen=True):
    """Blocks that entered the prefix cache: a chain (each block the next one's parent) hanging
    below ``parent`` (None: the start of a sequence). A block is ``block_size`` page-aligned tokens
    of a cached path; its hash chains the namespace, every earlier block and its own tokens
    (``services/scheduler/kv_events.py``)."""

    hashes: list[int]  # signed 64-bit, one per block
    parent: int | None
    tokens: list[int]  # block_size token ids per block, in order
    block_size: int
    ns: str = ""  # cache namespace (cache_salt)


class KvRemoved(msgspec.Struct, tag="removed", frozen=True):
    """Blocks that left the prefix cache (evicted, flushed), children before parents."""

    hashes: list[int]


class KvCleared(msgspec.Struct, tag="cleared", frozen=True):
    """Every block left the cache (the worker was lost, or a snapshot follows)."""


class KvEvents(msgspec.Struct, tag="kv", frozen=True):
    """A scheduler step's KV-cache events, in order, to a subscribed replica (``KvSubscribe``).
    ``snapshot``: the whole cache (a ``KvCleared``, then every block, parents first), the first
    batch a replica gets after subscribing."""

    seq: int  # the scheduler's batch number (diagnostics; replicas number their own streams)
    ts: float  # wall clock, seconds
    events: list[KvStored | KvRemoved | KvCleared]
    snapshot: bool = False


class FlushCacheDone(msgspec.Struct, tag="flushed", frozen=True):
    """Answer to ``FlushCacheReq``: ``ok`` when the cache was flushed, else why not."""

    token: str
    ok: bool
    message: str = ""


ToTokenizer = ModelInfo | TokenOutBatch | Load | Reply | EngineStatus | KvEvents | FlushCacheDone
