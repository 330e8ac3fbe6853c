"""The scheduler's side of prompt log-probs, without a worker: which positions each prompt chunk
asks for (``step_io.with_extras``), what the worker's answer puts into the request
(``take_prompt_logprobs``), the prefix-cache cap (``Req.prefix_key``), and that they are sent once.
The worker's own gather (``score_positions``) stands in for it: each value is its target's position."""

from __future__ import annotations

import numpy as np

from shared.messages.common import SamplingParams, f32, i32
from shared.messages.to_scheduler import StepOutput
from shared.messages.to_worker import ForwardBatch
from services.scheduler.batcher import Scheduled
from services.scheduler.request import Req
from services.scheduler.requests import token_out
from services.scheduler.step_io import take_prompt_logprobs, with_extras
from services.worker.sampling.batch import score_positions

BASE = 100  # prompt token i is BASE + i


def req(n: int, start: int, top: int = 0) -> Req:
    return Req(rid="r", replica=b"t", prompt=list(range(BASE, BASE + n)),
               params=SamplingParams(max_new_tokens=4, prompt_logprobs_from=start, prompt_top_logprobs=top))


def chunk(r: Req, start: int, n: int) -> Scheduled:
    emits = start + n == len(r.prompt)
    msg = ForwardBatch(step_id=0, new_reqs=[], released_rows=[], rows=i32([0]), prefix_lens=i32([start]),
                       extend_lens=i32([n]), emits=i32([int(emits)]), input_ids=i32(r.tokens(start, start + n)),
                       out_slots=i32([0] * n))
    s = Scheduled(step_id=0, reqs=[r], extend=[n], emits=[emits], num_tokens=n, prefill_tokens=n, msg=msg)
    s.msg = with_extras(s, None)
    return s


def answer(s: Scheduled, k: int = 0) -> StepOutput:
    """What the worker returns: per scored position its target's position (and k fake alternatives)."""
    if not s.msg.score_rows:
        return StepOutput(step_id=0, next_ids=i32([-1]))
    _, targets, counts = score_positions(s.msg)
    values = (targets - BASE).astype(np.float32)
    extra = {}
    if k:
        extra = dict(prompt_top_k=k, prompt_top_ids=i32(np.repeat(targets, k)),
                     prompt_top_logprobs=f32(np.repeat(values, k) - np.tile(np.arange(k), len(values))))
    return StepOutput(step_id=0, next_ids=i32([-1]), prompt_logprobs=f32(values), prompt_logprob_counts=i32(counts),
                      **extra)


def test_from_the_first_token_across_chunks_with_alternatives():
    r = req(50, 0, top=2)
    assert r.prefix_key() == []  # (position 0's logits predict token 1: nothing may come from the cache)
    for start, n in ((0, 20), (20, 20), (40, 10)):
        s = chunk(r, start, n)
        take_prompt_logprobs(s, answer(s, k=3))
    assert r.prompt_logprobs == list(range(1, 50))  # positions 1..49 (0 has no logprob), each once
    assert r.prompt_top_ids == [[BASE + p] * 2 for p in range(1, 50)]  # (the 2 asked for of the 3 sent)
    assert r.prompt_top_logprobs[0] == [1.0, 0.0]


def test_the_cache_serves_the_positions_before_the_start():
    r = req(50, 30)
    assert len(r.prefix_key()) == 29  # position 29's logits are the first wanted
    s = chunk(r, 29, 21)
    take_prompt_logprobs(s, answer(s))
    assert r.prompt_logprobs == list(range(30, 50))


def test_a_retraction_while_a_chunk_is_in_flight_scores_each_position_once():
    """Overlap: the second chunk's answer arrives after the request was retracted; resuming, it
    recomputes from the cache without asking for those positions again."""
    r = req(50, 5)
    first = chunk(r, 0, 20)
    take_prompt_logprobs(first, answer(first))
    second = chunk(r, 20, 20)  # in flight ...
    assert len(r.prefix_key()) == 40  # ... a retraction now: its positions so far may come from the cache
    take_prompt_logprobs(second, answer(second))  # (the answer comes in after the retraction)
    again = chunk(r, 35, 15)  # resuming: the cache matched less than what was scored
    take_prompt_logprobs(again, answer(again))
    assert r.prompt_logprobs == list(range(5, 50))


def test_sent_once_then_no_more_scoring():
    r = req(10, 2)
    s = chunk(r, 0, 10)
    take_prompt_logprobs(s, answer(s))
    r.output.append(7)
    r.unsent = 1
    out = token_out(r)
    assert out.prompt_logprobs == list(range(2, 10)) and not r.scoring
    r.unsent = 1
    assert token_out(r).prompt_logprobs == []
    assert len(r.prefix_key()) == 10  # (no cap once sent: prompt + output may come from the cache)
    decode = chunk(r, 10, 1)  # a decode step's own row: no scored positions
    assert not decode.msg.score_rows


def test_without_prompt_logprobs_nothing_is_scored():
    r = Req(rid="p", replica=b"t", prompt=list(range(BASE, BASE + 10)), params=SamplingParams())
    assert not chunk(r, 0, 10).msg.score_rows and len(r.prefix_key()) == 9
