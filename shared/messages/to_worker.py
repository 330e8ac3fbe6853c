"""Messages worker rank 0 receives from the scheduler: new requests once, then per-step diffs; KV
copies between cache tiers (``CacheOps``) when the hierarchical cache is on."""

from __future__ import annotations

import enum

import msgspec

from shared.messages.common import SamplingParams


class WorkerSetup(msgspec.Struct, tag="setup", frozen=True):
    """Sizes the worker's request table mirror (rows of ``req_to_token``)."""

    max_running_requests: int


class NewReq(msgspec.Struct, frozen=True):
    """Sent once when a request first enters a batch."""

    rid: str
    row: int  # its row in req_to_token
    params: SamplingParams
    prefix_slots: bytes = b""  # int32: KV slots of the cached prefix (matched in the scheduler)
    output_ids: bytes = b""  # int32: tokens already generated (a retracted request resuming; penalties)
    prompt_len: int = 0  # its prompt's tokens (min_new_tokens counts the new ones after it)
    prompt_ids: bytes = b""  # int32: the whole prompt, when a repetition penalty needs it
    traceparent: str = ""  # W3C trace context (the scheduler's span of the request): stage logs, worker span


class ForwardBatch(msgspec.Struct, tag="batch", frozen=True):
    """One model step. Per scheduled request: its row, how many tokens are already in its KV, how
    many new tokens to compute now, and whether to sample after them. The new tokens' ids and
    their freshly allocated KV slots are concatenated in batch order. O(new tokens), never
    O(context)."""

    step_id: int
    new_reqs: list[NewReq]
    released_rows: list[int]  # rows of requests that left since the last batch
    rows: bytes  # int32 (B,)
    prefix_lens: bytes  # int32 (B,)
    extend_lens: bytes  # int32 (B,)
    emits: bytes  # int32 (B,) 1 = the step emits this request's next token (its last position is computed now)
    input_ids: bytes  # int32 (sum extend,); -1: the token the worker sampled last for this row (overlap)
    out_slots: bytes  # int32 (sum extend,)
    # Scoring requests (prompt logprobs) in this batch, when any: batch position, first position whose
    # logits are needed, and the prompt token after the chunk (-1: none) — the target of its last logit.
    score_rows: bytes = b""  # int32 (S,)
    score_from: bytes = b""  # int32 (S,)
    score_next: bytes = b""  # int32 (S,)
    mask_rows: bytes = b""  # int32 (M,): batch positions of grammar-constrained sampling requests
    bitmask: bytes = b""  # int32 (M, ceil(V/32)): allowed-token bits per such request (bit i = token i)
    # Overlap scheduling: the bitmask comes later in a ``StepMask`` (the scheduler fills it once the
    # previous step's tokens are known); the worker runs the forward meanwhile and samples after.
    mask_deferred: bool = False
    mask_fill_ms: float = 0.0  # scheduler time filling ``bitmask`` (metrics)
    follows: bool = False  # sent while the previous step's requests were still being served (idle metric)
    # Shared-prefix (cascade) attention: requests of a group share the KV of their first cascade_lens[g]
    # positions; the worker reads it once for the group. Empty: none this step.
    cascade_group: bytes = b""  # int32 (B,): each request's group, -1 for none
    cascade_lens: bytes = b""  # int32 (G,): each group's shared prefix length (<= its members' prefix_lens)
    # Hierarchical cache: load ops (``CacheOps``) acknowledged since the last batch; their requests may be
    # in this one. Every rank's compute stream waits for its own copy of them (rank 0's are done already).
    cache_ready: bytes = b""  # int32 op ids


class StepMask(msgspec.Struct, tag="mask", frozen=True):
    """The deferred bitmask of step ``step`` (rows as in its ``ForwardBatch.mask_rows``)."""

    step_id: int
    bitmask: bytes  # int32 (M, ceil(V/32))
    fill_ms: float = 0.0  # scheduler time filling it (metrics)


class CopyKind(enum.StrEnum):
    """What a ``CacheOp`` moves (device = the KV pool the model reads; host = pinned host memory)."""

    BACKUP = "backup"  # device → host, on the copy stream; the device slots stay in use (write-through)
    DEMOTE = "demote"  # device → host; the device slots were freed: the next forward waits for it (write-back)
    LOAD = "load"  # host → device, on the copy stream (the scheduler admits the request once it is acked)
    DISK_WRITE = "disk_write"  # host → a new file (the writer thread)
    DISK_READ = "disk_read"  # a file → host (the reader thread; payload checksum checked)
    DISK_DELETE = "disk_delete"  # remove a file (the writer thread, after any write of it)


class CacheOp(msgspec.Struct, frozen=True, omit_defaults=True):
    """One copy between tiers, acknowledged by ``CacheAck`` (done or failed) under ``op_id``. Slot
    arrays are token-aligned: token i of ``device`` ↔ token i of ``host``."""

    op_id: int
    kind: CopyKind
    device: bytes = b""  # int32: KV pool slots (backup, demote, load)
    host: bytes = b""  # int32: host pool slots (all but disk_delete)
    file: int = -1  # disk file id (disk ops)
    offset: int = 0  # disk_read: first token of the file to read
    # disk_write: what the file holds, for the index rebuilt after a restart — the cache namespace and the
    # token ids from the namespace's root to the last token written; the file holds path[start:]
    ns: str = ""
    path: bytes = b""  # int32
    start: int = 0
    after: list[int] = []  # load: disk reads that fill its host slots (ranks > 0 may still be reading)


class CacheOps(msgspec.Struct, tag="cacheops", frozen=True):
    """Copies to start now, in order, before the next ``ForwardBatch`` (sent just before it)."""

    ops: list[CacheOp]


class Shutdown(msgspec.Struct, tag="shutdown", frozen=True):
    pass


ToWorker = WorkerSetup | ForwardBatch | StepMask | CacheOps | Shutdown
