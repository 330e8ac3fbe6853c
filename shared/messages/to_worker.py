"""Messages worker rank 0 receives from the scheduler: new requests once, then per-step diffs."""

from __future__ import annotations

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


class StepMask(msgspec.Struct, tag="mask", frozen=True):
    """The deferred bitmask of step ``step`` (rows as in its ``ForwardBatch.mask_rows``)."""

    step_id: int
    bitmask: bytes  # int32 (M, ceil(V/32))
    fill_ms: float = 0.0  # scheduler time filling it (metrics)


class Shutdown(msgspec.Struct, tag="shutdown", frozen=True):
    pass


ToWorker = WorkerSetup | ForwardBatch | StepMask | Shutdown
