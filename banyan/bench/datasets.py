"""Benchmark workloads. A request is token ids (or text) plus an output length and, for the json
workload, a schema. Token-id prompts are random ids from a safe range of the vocabulary, so the
input length is exact and no tokenizer is needed on the client."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field

# A schema that random-weight and real models alike complete in a bounded number of tokens.
JSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]{0,15}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "pattern": "^[A-Z][a-z]{0,15}$"},
        "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,8}$"}, "maxItems": 4},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}


@dataclass(frozen=True)
class BenchRequest:
    prompt_ids: list[int] = field(default_factory=list)
    prompt_text: str = ""
    output_len: int = 128
    json_schema: str = ""
    priority: int = 0  # GenerateRequest.priority (the server uses it with --enable-priority-scheduling)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids) if self.prompt_ids else len(self.prompt_text.split())


def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    lo, hi = min(1000, vocab // 4), vocab - 1  # skip the low ids where special tokens usually live
    return [rng.randrange(lo, hi) for _ in range(n)]


def random_requests(num: int, input_len: tuple[int, int], output_len: tuple[int, int], vocab: int,
                    seed: int = 0) -> list[BenchRequest]:
    rng = random.Random(seed)
    return [BenchRequest(prompt_ids=_ids(rng, rng.randint(*input_len), vocab), output_len=rng.randint(*output_len))
            for _ in range(num)]


def shared_prefix_requests(groups: int, prompts_per_group: int, system_len: int, question_len: int,
                           output_len: int, vocab: int, seed: int = 0) -> list[BenchRequest]:
    """``groups`` system prompts, each followed by ``prompts_per_group`` different questions;
    shuffled so a cache-aware scheduler has something to do."""
    rng = random.Random(seed)
    out = []
    for _ in range(groups):
        system = _ids(rng, system_len, vocab)
        out += [BenchRequest(prompt_ids=system + _ids(rng, question_len, vocab), output_len=output_len)
                for _ in range(prompts_per_group)]
    rng.shuffle(out)
    return out


def json_requests(num: int, input_len: int, output_len: int, vocab: int, seed: int = 0) -> list[BenchRequest]:
    rng = random.Random(seed)
    schema = json.dumps(JSON_SCHEMA)
    return [BenchRequest(prompt_ids=_ids(rng, input_len, vocab), output_len=output_len, json_schema=schema)
            for _ in range(num)]


def sharegpt_requests(path: str, num: int, max_output: int = 1024, seed: int = 0) -> list[BenchRequest]:
    """First human turn as the prompt; the length of the answer that follows, in words × 1.3, as
    the output length (capped)."""
    with open(path) as f:
        data = json.load(f)
    rng = random.Random(seed)
    rng.shuffle(data)
    out = []
    for conv in data:
        turns = conv.get("conversations") or conv.get("conversation") or []
        if len(turns) < 2:
            continue
        prompt, answer = turns[0].get("value", ""), turns[1].get("value", "")
        if not prompt or not answer:
            continue
        out.append(BenchRequest(prompt_text=prompt, output_len=max(4, min(max_output, int(len(answer.split()) * 1.3)))))
        if len(out) == num:
            break
    return out


@dataclass(frozen=True)
class Conversation:
    """A multi-turn chat as token ids: a system prompt, then per turn a user message and how many
    tokens the answer gets. Turn t's prompt is the system prompt, every earlier turn (user message
    and the answer the server gave) and user message t."""

    system: list[int]
    users: list[list[int]]
    output_lens: list[int]


def multiturn_conversations(num: int, turns: int, system_len: int, user_len: tuple[int, int],
                            output_len: tuple[int, int], vocab: int, seed: int = 0) -> list[Conversation]:
    """``num`` conversations sharing one system prompt (W6: 64 × 8 turns, 2,048 + ~256 per turn, ~128 out)."""
    rng = random.Random(seed)
    system = _ids(rng, system_len, vocab)
    return [Conversation(system, [_ids(rng, rng.randint(*user_len), vocab) for _ in range(turns)],
                         [rng.randint(*output_len) for _ in range(turns)]) for _ in range(num)]
