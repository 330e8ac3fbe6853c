"""The multi-turn workload (W6): conversations whose every turn resends the whole history, in a
closed loop — ``concurrency`` users each send the next ready turn as soon as they are free, and a
conversation's next turn is ready once its answer is back (it joins the back of the queue, so the
other conversations' turns come between two of its own: its history must survive them in some
cache tier to be reused). Reports TTFT by turn and the cache hit rate next to the optimum (``optimum_cached``)."""

from __future__ import annotations

import asyncio
import bisect
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
    sent: list[tuple[list[int], list[int], bool]] = []  # each request sent: (prompt, prompt + output, ok)

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
            sent.append((prompt, prompt + res.output_ids, res.ok))  # (all the cache can ever hold of it)
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
    ok = [k for k, (_, _, good) in enumerate(sent) if good]
    total_prompt = sum(len(sent[k][0]) for k in ok)
    optimum = optimum_cached([p for p, _, _ in sent], [q for _, q, _ in sent], ok)
    out["optimum_hit_rate"] = optimum / total_prompt if total_prompt else 0.0
    return out


def optimum_cached(prompts: list[list[int]], seqs: list[list[int]], which: list[int]) -> int:
    """The most prompt tokens of requests ``which`` that any cache could have served, starting empty:
    each prompt's longest prefix shared with another request's prompt + output (whatever the order the
    server ran them in; nothing else existed), at most all but its last token, less the least of them
    (the first request the server ran found nothing). A run — with the cache empty of these tokens at
    its start: ``banyan bench`` salts each multi-turn run — cannot exceed it."""
    if not which:
        return 0
    order = sorted(range(len(seqs)), key=lambda k: seqs[k])
    keys = [seqs[k] for k in order]
    best = []
    for k in which:
        p = prompts[k]
        at = bisect.bisect_left(keys, p)
        found = 0
        for step, start in ((-1, at - 1), (1, at)):  # the nearest other sequence on each side has the longest LCP
            j = start
            while 0 <= j < len(keys) and order[j] == k:
                j += step
            if 0 <= j < len(keys):
                found = max(found, _lcp(p, keys[j]))
        best.append(min(found, len(p) - 1))
    return sum(best) - min(best)


def _lcp(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def by_turn(convs: list[Conversation], results: list[tuple[int, int, Result]]) -> dict:
    """TTFT and hit rate per turn."""
    turns = max(len(c.users) for c in convs)
    ttft, hit = [], []
    for t in range(turns):
        rs = [r for _, k, r in results if k == t and r.ok]
        ttft.append(_dist([r.ttft for r in rs]))
        prompt = sum(r.prompt_len for r in rs)
        hit.append(sum(r.cached_tokens for r in rs) / prompt if prompt else 0.0)
    later = [r.ttft for _, k, r in results if k > 0 and r.ok]
    return {"ttft_by_turn_ms": ttft, "ttft_later_turns_ms": _dist(later), "hit_rate_by_turn": hit}
