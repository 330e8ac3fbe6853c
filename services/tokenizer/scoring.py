"""Scoring continuations of a prompt (the frontend's ``select``): each continuation becomes one
prompt-only request whose logprobs from the continuation's first token on come back; the prefix
cache (and in-batch dedup) computes the shared prompt once."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from shared.errors import Internal, InvalidArgument
from shared.messages.common import SamplingParams
from shared.messages.to_scheduler import GenerateReq
from shared.messages.to_tokenizer import ModelInfo
from services.tokenizer import validation
from services.tokenizer.scheduler_client import SchedulerClient
from services.tokenizer.text import TextProcessor
from services.tokenizer.validation import Prompt

MAX_CONTINUATIONS = 64


@dataclass(frozen=True)
class Scored:
    token_ids: list[int]
    logprobs: list[float]
    cached_tokens: int

    @property
    def total(self) -> float:
        return sum(self.logprobs)

    @property
    def mean(self) -> float:
        return self.total / len(self.logprobs)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class Scorer:
    def __init__(self, text: TextProcessor, client: SchedulerClient) -> None:
        self.text, self.client = text, client

    def sequences(self, prompt: Prompt, continuations: list[str], info: ModelInfo) -> tuple[int, list[tuple[list[int], int]]]:
        """(prompt tokens, [(prompt + continuation ids, index of the first continuation token)])."""
        if not 0 < len(continuations) <= MAX_CONTINUATIONS:
            raise InvalidArgument(f"continuations: 1..{MAX_CONTINUATIONS} are needed, got {len(continuations)}")
        if not all(continuations):
            raise InvalidArgument("continuations must not be empty strings")
        validation.check_text_size(sum(map(len, continuations)), info, "the continuations")
        base = validation.input_ids(prompt, self.text, info)
        if prompt.text is not None:
            def full(c: str) -> list[int]:
                return self.text.encode(prompt.text + c)
        elif prompt.messages is not None:
            rendered = self.text.render_chat(prompt.messages, prompt.add_generation_prompt)

            def full(c: str) -> list[int]:
                return self.text.encode(rendered + c, add_special_tokens=False)
        else:
            def full(c: str) -> list[int]:
                return base + self.text.encode(c, add_special_tokens=False)
        out = []
        for i, c in enumerate(continuations):
            ids = full(c)
            if ids == base:
                raise InvalidArgument(f"continuations[{i}] adds no tokens to the prompt")
            start = max(1, min(_common_prefix(base, ids), len(ids) - 1))  # merged tokens count as the answer's
            if len(ids) >= info.context_length:
                raise InvalidArgument(f"continuations[{i}]: prompt + continuation exceed the context window")
            out.append((ids, start))
        return len(base), out

    async def score(self, rid: str, seqs: list[tuple[list[int], int]], cache_ns: str = "",
                    traceparent: str = "") -> list[Scored]:
        await self.client.watch.wait_serving()  # a scheduler restarting: wait for it (bounded)
        route = self.client.route(seqs[0][0], cache_ns)  # one group for all: they share the prompt's KV

        async def one(i: int, ids: list[int], start: int) -> Scored:
            params = SamplingParams(temperature=0.0, max_new_tokens=0, prompt_logprobs_from=start)
            out = await self.client.final(GenerateReq(rid=f"{rid}.{i}", input_ids=ids, params=params,
                                                      cache_ns=cache_ns, traceparent=traceparent), route)
            if len(out.prompt_logprobs) != len(ids) - start:
                raise Internal(f"expected {len(ids) - start} prompt logprobs, got {len(out.prompt_logprobs)}")
            return Scored(ids[start:], list(out.prompt_logprobs), out.cached_tokens)

        return list(await asyncio.gather(*(one(i, ids, s) for i, (ids, s) in enumerate(seqs))))
