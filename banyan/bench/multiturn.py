"""The multi-turn workload (W6): conversations whose every turn resends the whole history, in a
closed loop — ``concurrency`` users each send the next ready turn as soon as they are free, and a
conversation's next turn is ready once its answer is back (it joins the back of the queue, so the
other conversations' turns come between two of its own: its history must survive them in some
cache tier to be reused). Reports TTFT by turn and the cache hit rate next to the optimum."""

from __future__ import annotations

import asyncio
import time
from collections import deque

from banyan.bench.backends import Result
from banyan.bench.datasets import BenchRequest, Conversation
from banyan.bench.runner import _dist, summarize


async def run_multiturn(backend, convs: list[Conversation], concurrency: int, temperature: float = 0.0,
                        progress: bool = True, record: dict | None = None, replay: dict | None = None) -> dict:
    """``record``: filled with each turn's prompt by (conversation, turn); ``replay``: such a record,
    whose prompts are sent instead of the history this run's answers make (a second pass then asks
    for exactly the first pass's token sequences, whatever the model answers this time)."""
    histories = [list(c.system) for c in convs]
    ready: deque[tuple[int, int]] = deque((i, 0) for i in range(len(convs)))  # (conversation, turn)
    results: list[tuple[int, int, Result]] = []
    total = sum(len(c.users) for c in convs)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=total, desc="turns", unit="turn")
    wake = asyncio.Event()

    async def user() -> None:
        while len(results) < total:
            if not ready:
                wake.clear()
                await wake.wait()
                continue
            i, t = ready.popleft()
            conv = convs[i]
            prompt = replay[(i, t)] if replay is not None else histories[i] + conv.users[t]
            if record is not None:
                record[(i, t)] = prompt
            res = await backend.send(BenchRequest(prompt_ids=prompt, output_len=conv.output_lens[t]), True, temperature)
            results.append((i, t, res))
            if not res.ok:  # (the conversation cannot go on without its answer)
                results.extend((i, k, Result(ok=False, prompt_len=0, error="an earlier turn failed"))
                               for k in range(t + 1, len(conv.users)))
            else:
                histories[i] = prompt + res.output_ids
                if t + 1 < len(conv.users):
                    ready.append((i, t + 1))
            wake.set()
            if bar is not None:
                bar.update(1)

    start = time.perf_counter()
    await asyncio.gather(*(user() for _ in range(max(1, concurrency))))
    duration = time.perf_counter() - start
    if bar is not None:
        bar.close()
    out = summarize([r for _, _, r in results], duration, start)
    out.update(by_turn(convs, results), conversations=len(convs), turns=max(len(c.users) for c in convs),
               concurrency=concurrency)
    return out


def by_turn(convs: list[Conversation], results: list[tuple[int, int, Result]]) -> dict:
    """TTFT and hit rate per turn; the optimum hit rate: every prompt token but the new user message
    (and the system prompt of the very first request) could have come from the cache."""
    turns = max(len(c.users) for c in convs)
    ttft, hit, optimum = [], [], 0
    first = True
    prompt_total = 0
    for t in range(turns):
        rs = [(i, r) for i, k, r in results if k == t and r.ok]
        ttft.append(_dist([r.ttft for _, r in rs]))
        prompt = sum(r.prompt_len for _, r in rs)
        hit.append(sum(r.cached_tokens for _, r in rs) / prompt if prompt else 0.0)
        for i, r in rs:
            reusable = r.prompt_len - len(convs[i].users[t])
            if t == 0 and first:
                reusable, first = 0, False
            optimum += reusable
            prompt_total += r.prompt_len
    later = [r.ttft for _, k, r in results if k > 0 and r.ok]
    return {"ttft_by_turn_ms": ttft, "ttft_later_turns_ms": _dist(later), "hit_rate_by_turn": hit,
            "optimum_hit_rate": optimum / prompt_total if prompt_total else 0.0}
