"""Messages the scheduler receives: from tokenizer replicas and from worker rank 0."""

from __future__ import annotations

import enum

import msgspec

from shared.messages.common import Constraint, FinishReason, SamplingParams


class TokenizerHello(msgspec.Struct, tag="hello", frozen=True):
    """A tokenizer replica connected; the scheduler answers with ``ModelInfo``."""

    replica: str


class SessionTurn(msgspec.Struct, frozen=True):
    """A generation that continues a session: its prompt is the ``parent`` turn's tokens followed by
    the request's ``input_ids``; when it ends (stop or length) prompt + output become the session's
    turn ``rid``, pinned in the prefix cache."""

    session_id: str
    parent: str  # the turn it continues ("": the session's empty start), resolved by the tokenizer
    context_tokens: int  # that turn's length as the tokenizer saw it (the scheduler re-checks)


class PinSpec(msgspec.Struct, frozen=True):
    """A prompt-only request (``max_new_tokens`` 0) whose prompt is pinned in the prefix cache once
    computed: ``PinPrefix``; the request id is the pin's id."""

    ttl_s: float = 0.0  # seconds until it is unpinned by itself (0: until UnpinPrefix)


class GenerateReq(msgspec.Struct, tag="gen", frozen=True):
    """A tokenized, validated request. Token ids only: text never reaches the scheduler."""

    rid: str
    input_ids: list[int]
    params: SamplingParams
    n: int = 1  # parallel samples: branches share the prompt's KV
    cache_ns: str = ""  # cache namespace (cache_salt): KV is never shared across namespaces
    constraint: Constraint | None = None  # structured output
    traceparent: str = ""
    priority: int = 0  # higher = more urgent (used with --enable-priority-scheduling)
    session: SessionTurn | None = None  # a turn of a session (input_ids: the new tokens only)
    pin: PinSpec | None = None  # PinPrefix: prefill the prompt and pin it


class AbortReq(msgspec.Struct, tag="abort", frozen=True):
    """Stop a request (client cancel, deadline, or a stop string matched in the tokenizer)."""

    rid: str
    reason: FinishReason = FinishReason.ABORT  # ABORT, or STOP: the tokenizer matched a stop string
    index: int = -1  # one branch of an n > 1 request, or -1 for all
    output_tokens: int = -1  # STOP: the output tokens the client got (a session turn keeps those); -1: all


class SessionOpKind(enum.StrEnum):
    OPEN = "open"
    CLOSE = "close"
    INFO = "info"  # the turn a new one would continue (and the room left), before tokenizing it


class SessionOp(msgspec.Struct, tag="session", frozen=True):
    """Open, close or look up a session; answered with ``Reply`` carrying the same token."""

    token: str
    op: SessionOpKind
    session_id: str
    ttl_s: float = 0.0  # open: idle seconds until it expires
    capacity: int = 0  # open: tokens it may hold at most (all its turns' unique tokens)
    cache_ns: str = ""  # open: its cache namespace
    parent: str = ""  # info: the turn to continue ("": the latest one)


class UnpinReq(msgspec.Struct, tag="unpin", frozen=True):
    """Unpin a pinned prefix (``PinPrefix``'s id); answered with ``Reply``."""

    token: str
    pin_id: str


class LoadReq(msgspec.Struct, tag="load", frozen=True):
    """Ask for the scheduler's current load; answered with ``Load`` carrying the same token."""

    token: str


class KvSubscribe(msgspec.Struct, tag="kvsub", frozen=True):
    """A tokenizer replica wants the scheduler's KV-cache events (``on``; it repeats this every few
    seconds while it does, and a subscription not renewed for ``KV_LEASE_S`` ends) or no longer
    wants them. A replica that was not subscribed first gets a snapshot (every cached block)."""

    on: bool = True


class FlushCacheReq(msgspec.Struct, tag="flush", frozen=True):
    """Drop every cached prefix now, if no request is in flight; answered with ``FlushCacheDone``."""

    token: str


KV_LEASE_S = 10.0  # a KvSubscribe not renewed for this long ends the subscription (the replica is gone)


class DiskFile(msgspec.Struct, frozen=True):
    """One file of the disk tier, as its header says: ``path[start:]``'s KV in namespace ``ns``."""

    file: int
    ns: str
    path: bytes  # int32 token ids from the namespace's root to the file's last token
    start: int
    size: int  # bytes on disk


class WorkerReady(msgspec.Struct, tag="ready", frozen=True):
    """Worker rank 0 loaded the model and sized its KV pool."""

    model: str
    architecture: str
    vocab_size: int
    context_length: int
    pool_size: int  # usable KV slots (tokens)
    eos_token_ids: list[int]
    device: str
    dtype: str
    cuda_graph_max_bs: int = 0  # the largest pure-decode batch it replays as a CUDA graph (0: none)
    kv_cache_dtype: str = ""  # what the KV pool stores: the model dtype's name or "fp8_e4m3" ("": not said)
    quantization: str = ""  # the weights' quantization ("" for none), e.g. "fp8"
    # Hierarchical cache (0 / empty: off). Host pool and disk sizes are per rank (each holds its KV heads).
    host_pool_size: int = 0  # usable host-memory KV slots (tokens)
    kv_bytes_per_token: int = 0  # this rank's K and V of one token, all layers
    disk_capacity: int = 0  # bytes the disk tier may use (--hicache-storage-size)
    disk_files: list[DiskFile] = []  # what is on disk from earlier runs (checked headers; every rank has them)
    disk_next_file: int = 0  # the first file id no earlier file uses


class StepOutput(msgspec.Struct, tag="out", frozen=True):
    """Sampled ids for one ``ForwardBatch``, in batch order; -1 where no token was sampled."""

    step_id: int
    next_ids: bytes  # int32 (B,)
    forward_ms: float = 0.0
    busy_ms: float = 0.0  # the step's device time (first input copy to last output; wall time on a CPU)
    # Only when a request in the batch asked for logprobs (rows of the others are 0):
    logprobs: bytes = b""  # float32 (B,): log-probability of each sampled token
    top_k: int = 0  # alternatives per row
    top_ids: bytes = b""  # int32 (B, top_k)
    top_logprobs: bytes = b""  # float32 (B, top_k)
    prompt_logprobs: bytes = b""  # float32: per score row (batch order), its chunk's scored positions
    prompt_logprob_counts: bytes = b""  # int32 (S,): how many of them each score row has
    prompt_top_k: int = 0  # alternatives per scored position (the most any score row asked for)
    prompt_top_ids: bytes = b""  # int32 (P, prompt_top_k), P = all the scored positions, in order
    prompt_top_logprobs: bytes = b""  # float32 (P, prompt_top_k)


class CacheAck(msgspec.Struct, tag="cack", frozen=True):
    """``CacheOp``s that ended since the last ack: done (with the seconds each took) or failed (why)."""

    done: bytes = b""  # int32 op ids
    seconds: bytes = b""  # float32, one per done op: its copy time (device events; wall time on the CPU / disk)
    failed: bytes = b""  # int32 op ids
    reasons: list[str] = []  # one per failed op: "disk_full: …", "corrupt: …", "io: …", "copy: …"


class WorkerError(msgspec.Struct, tag="werr", frozen=True):
    """The worker failed to execute a batch; the scheduler fails the requests in it."""

    step_id: int
    message: str


ToScheduler = (TokenizerHello | GenerateReq | AbortReq | LoadReq | SessionOp | UnpinReq | KvSubscribe | FlushCacheReq
               | WorkerReady | StepOutput | CacheAck | WorkerError)
