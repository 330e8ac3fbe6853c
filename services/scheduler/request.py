"""The scheduler's view of one request: token ids, KV slots, progress. No tensors."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from shared.messages.common import SamplingParams


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
    traceparent: str = ""
    output: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    row: int = -1  # req_to_token row while running
    slots: list[int] = field(default_factory=list)  # KV slots of positions 0..len(slots)-1
    cached_tokens: int = 0
    finish: str = ""  # set when finished: stop | length | abort | error
    aborted: str = ""  # pending abort reason, applied at the next step boundary
    arrival: float = field(default_factory=time.monotonic)
    unsent: int = 0  # output tokens not yet sent to the tokenizer

    @property
    def seq(self) -> list[int]:
        """All tokens whose KV the request needs: prompt + generated (the last is not yet in KV)."""
        return self.prompt + self.output

    @property
    def num_computed(self) -> int:
        """Tokens whose KV is in the pool."""
        return len(self.slots)

    @property
    def prefill_done(self) -> bool:
        return len(self.slots) >= len(self.prompt)

    @property
    def max_total_tokens(self) -> int:
        """Upper bound on the KV slots this request can ever hold."""
        return len(self.prompt) + self.params.max_new_tokens

    def wait_ms(self) -> float:
        return (time.monotonic() - self.arrival) * 1e3

    def check_finished(self, context_length: int) -> str:
        """Finish reason after the last sampled token, or "" to continue."""
        last = self.output[-1]
        if last in self.params.stop_token_ids:
            return "stop"
        if len(self.output) >= self.params.max_new_tokens or len(self.seq) >= context_length:
            return "length"
        return ""
