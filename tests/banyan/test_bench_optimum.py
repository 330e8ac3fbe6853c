"""The multi-turn bench's optimum hit rate is a bound: an ideal prefix cache (unbounded, starting
empty), fed the same requests in any order, never serves more of their prompts than it."""

from __future__ import annotations

import random

from banyan.bench.multiturn import optimum_cached


def ideal_cache_hits(prompts: list[list[int]], seqs: list[list[int]], order: list[int]) -> int:
    """Prompt tokens an unbounded prefix cache serves when the requests run one after another in
    ``order`` (each inserts its prompt + output once done)."""
    seen: set[tuple[int, ...]] = set()
    hits = 0
    for k in order:
        p = prompts[k]
        n = 0
        while n < len(p) - 1 and tuple(p[:n + 1]) in seen:
            n += 1
        hits += n
        seen.update(tuple(seqs[k][:j]) for j in range(1, len(seqs[k]) + 1))
    return hits


def conversations(rng: random.Random, vocab: int) -> tuple[list[list[int]], list[list[int]]]:
    system = [rng.randrange(vocab) for _ in range(6)]
    prompts, seqs = [], []
    for _ in range(4):
        history = list(system)
        for _ in range(3):
            prompt = history + [rng.randrange(vocab) for _ in range(rng.randint(1, 4))]
            seq = prompt + [rng.randrange(vocab) for _ in range(rng.randint(1, 3))]
            prompts.append(prompt)
            seqs.append(seq)
            history = seq
    return prompts, seqs


def test_no_order_beats_the_optimum() -> None:
    rng = random.Random(0)
    for trial in range(200):
        prompts, seqs = conversations(rng, vocab=3 if trial % 2 else 50)  # a tiny vocabulary: chance matches
        optimum = optimum_cached(prompts, seqs, list(range(len(prompts))))
        for _ in range(5):
            # an order in which each conversation's turns come in turn order (as the bench sends them)
            order = sorted(range(len(prompts)), key=lambda k: (k % 3, rng.random()))
            assert ideal_cache_hits(prompts, seqs, order) <= optimum


def test_the_optimum_is_reached_on_a_plain_chat() -> None:
    """One conversation, no chance matches: every turn's history is reusable, the first turn's nothing."""
    prompts = [[1, 2, 3, 10], [1, 2, 3, 10, 20, 11], [1, 2, 3, 10, 20, 11, 21, 12]]
    seqs = [[1, 2, 3, 10, 20], [1, 2, 3, 10, 20, 11, 21], [1, 2, 3, 10, 20, 11, 21, 12, 22]]
    assert optimum_cached(prompts, seqs, [0, 1, 2]) == ideal_cache_hits(prompts, seqs, [0, 1, 2]) == 0 + 5 + 7
