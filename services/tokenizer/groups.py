"""The scheduler groups a tokenizer replica talks to: one DEALER link per group (one group, or N
with data parallelism), whether each is up and serving, and the one ``ModelInfo`` they must agree
on (any group may answer any request)."""

from __future__ import annotations

import time

import msgspec
import zmq.asyncio

from shared.config import ConfigError
from shared.messages.codec import Codec
from shared.messages.to_scheduler import ToScheduler
from shared.messages.to_tokenizer import ModelInfo, ToTokenizer
from shared.transport import AsyncDealerQueue

AGREE = ("model", "architecture", "vocab_size", "context_length", "max_running_requests", "eos_token_ids", "dtype")


class GroupLink:
    """One scheduler group."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, identity: str) -> None:
        self.endpoint = endpoint
        self.q: AsyncDealerQueue = AsyncDealerQueue(ctx, endpoint, Codec(ToTokenizer), Codec(ToScheduler),
                                                    identity=identity)
        self.info: ModelInfo | None = None
        self.answered = time.monotonic()  # when it last answered a load probe
        self.up = True
        self.down = ""  # why its engine is not serving (its worker was lost); "": serving

    @property
    def usable(self) -> bool:
        return self.up and not self.down


def merge_info(infos: list[ModelInfo]) -> ModelInfo:
    """One ``ModelInfo`` for all groups: they must agree on the model and the per-request limits;
    the pool is the smallest (a request runs in one group); devices are listed once each."""
    first = infos[0]
    for g, i in enumerate(infos[1:], 1):
        diff = [f for f in AGREE if getattr(i, f) != getattr(first, f)]
        if diff:
            raise ConfigError(f"data-parallel group {g} differs from group 0 in {', '.join(diff)}: "
                              f"{[getattr(i, f) for f in diff]} != {[getattr(first, f) for f in diff]}")
    return msgspec.structs.replace(first, pool_size=min(i.pool_size for i in infos),
                                   device=",".join(dict.fromkeys(i.device for i in infos)))
