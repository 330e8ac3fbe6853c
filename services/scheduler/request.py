"""The scheduler's view of one request branch: token ids, KV slots, progress. No tensors."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from shared.messages.common import FinishReason, SamplingParams, i32
from services.scheduler.cache import CacheHandle


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Req:
    rid: str
    replica: bytes  # identity of the tokenizer replica that owns the stream
    prompt: list[int]
    params: SamplingParams
    index: int = 0  # branch of a parallel-sampling (n > 1) request
    ns: str = ""  # cache namespace: requests in different namespaces never share KV
    traceparent: str = ""  # W3C trace context it arrived with
    span: Any = None  # its ``schedule`` span (shared.tracing.Span): queued → finished
    output: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    row: int = -1  # req_to_token row while running
    slots: list[int] = field(default_factory=list)  # KV slots of positions 0..len(slots)-1
    owned: set[int] = field(default_factory=set)  # slots this request owns (the rest are cached)
    lock_node: CacheHandle | None = None  # deepest prefix-cache node it holds a lock on
    matcher: Any = None  # grammar matcher (structured output), advanced with each sampled token
    cached_tokens: int = 0  # prompt tokens whose KV came from the cache
    finish: FinishReason | None = None  # set when finished
    aborted: FinishReason | None = None  # pending abort (ABORT, or STOP: a stop string), applied between steps
    retractions: int = 0
    arrival: float = field(default_factory=time.monotonic)
    priority: int = 0  # higher = more urgent (0 for all without --enable-priority-scheduling)
    queued_at: float = field(default_factory=time.monotonic)  # when it last joined the queue (aging)
    aged: bool = False  # waited --priority-aging-seconds: ahead of every level, never preempted
    anchor: Any = None  # a session turn or a pin (sessions.py / pins.py): told when the request ends
    keep_output: int = -1  # a stop string ended it: the output tokens the client got (-1: all)
    unsent: int = 0  # output tokens not yet sent to the tokenizer
    unsent_logprobs: list[float] = field(default_factory=list)  # their logprobs, when asked for
    unsent_top_ids: list[list[int]] = field(default_factory=list)
    unsent_top_logprobs: list[list[float]] = field(default_factory=list)
    prompt_logprobs: list[float] = field(default_factory=list)  # prompt log-probs (params.prompt_logprobs_from)
    prompt_top_ids: list[list[int]] = field(default_factory=list)  # and their alternatives (prompt_top_logprobs)
    prompt_top_logprobs: list[list[float]] = field(default_factory=list)
    prompt_lp_sent: bool = False  # they went out (with the first output): no prompt position is scored again
    prompt_lp_next: int = 0  # the first position whose logits no step has been asked for yet (resuming skips the rest)
    # Overlap scheduling: steps in flight that sample a token for it (at most 2, briefly), and how
    # many of those tokens to drop when they arrive (jump-forward appended others in their place).
    pending: int = 0
    discard: int = 0
    _key: tuple[int, int, list[int]] = (-1, -1, [])  # prefix_key() memo: (end, known_len, key)

    @property
    def in_flight(self) -> int:
        """Tokens being sampled by steps in flight that will count: not known yet, but part of seq."""
        return self.pending - self.discard

    @property
    def scoring(self) -> bool:
        """Prompt positions still need their logits (prompt log-probs asked for, not yet sent)."""
        return self.params.prompt_logprobs_from >= 0 and not self.prompt_lp_sent

    @property
    def trace_id(self) -> str:
        return self.traceparent[3:35]

    @property
    def seq(self) -> list[int]:
        """All tokens whose KV the request needs: prompt + generated (the last is not yet in KV)."""
        return self.prompt + self.output if self.output else self.prompt

    @property
    def num_computed(self) -> int:
        """Tokens whose KV is in the pool."""
        return len(self.slots)

    @property
    def known_len(self) -> int:
        """Prompt + generated tokens whose ids the scheduler has."""
        return len(self.prompt) + len(self.output)

    # (the batcher reads these for every running request each step: written out, not via each other)
    @property
    def seq_len(self) -> int:
        """Known tokens + the ones sampled by steps in flight."""
        return len(self.prompt) + len(self.output) + self.pending - self.discard

    @property
    def to_compute(self) -> int:
        """Tokens not yet in KV. 1 while decoding (the last sampled token); more while prefilling
        (a new prompt, or a retracted request resuming)."""
        return len(self.prompt) + len(self.output) + self.pending - self.discard - len(self.slots)

    def tokens(self, start: int, end: int) -> list[int]:
        """``seq[start:end]`` without building ``seq`` (O(end - start)); -1 for tokens still being
        sampled by a step in flight (the worker feeds its own sampled token there)."""
        p = len(self.prompt)
        if end <= p:
            return self.prompt[start:end]
        unknown = [-1] * (end - max(start, self.known_len)) if end > self.known_len else []
        if start >= p:
            return self.output[start - p:end - p] + unknown
        return self.prompt[start:] + self.output[:end - p] + unknown

    @property
    def remaining_new_tokens(self) -> int:
        return self.params.max_new_tokens - len(self.output) - self.pending + self.discard

    def prefix_key(self) -> list[int]:
        """Tokens whose KV may come from the cache: all but the last, whose logits are needed
        (requests with prompt log-probs need the logits of every position from ``first_scored`` - 1 that
        no step was asked for yet)."""
        end = self.seq_len - 1
        if self.scoring:  # (positions already scored may come from the cache: a retracted request resuming)
            end = min(end, max(self.params.first_scored - 1, self.prompt_lp_next))
        known = len(self.prompt) + len(self.output)
        memo = self._key
        if memo[0] != end or memo[1] != known:  # (computed once per step, read by policy, dedup, admission)
            memo = self._key = (end, known, self.tokens(0, end))
        return memo[2]

    def wait_ms(self) -> float:
        return (time.monotonic() - self.arrival) * 1e3

    def check_finished(self, context_length: int) -> FinishReason | None:
        """Finish reason after the last sampled token, or None to continue."""
        last = self.output[-1]
        if last in self.params.stop_token_ids:
            return FinishReason.STOP
        if len(self.output) >= self.params.max_new_tokens or len(self.prompt) + len(self.output) >= context_length:
            return FinishReason.LENGTH
        return None


def worker_extras(r: Req) -> dict:
    """What the worker's logit processors need of ``r`` beyond its params (``NewReq`` fields): its
    prompt length (min_new_tokens) and, for a repetition penalty, the prompt itself."""
    p = r.params
    if not p.processed:
        return {}
    extra: dict = {"prompt_len": len(r.prompt)}
    if p.repetition_penalty != 1.0:
        extra["prompt_ids"] = i32(r.prompt)
    return extra
