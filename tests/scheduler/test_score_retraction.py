"""The scheduler alone: a scoring request retracted before its last prompt token reports each
scored position once (no server; the e2e scoring tests are in ``tests/e2e/test_frontend.py``)."""

from __future__ import annotations


def test_scoring_request_retracted_mid_prefill_reports_each_position_once():
    """A 65-token scoring request in 32-token chunks sits one token from done (the scheduler treats
    it as decoding); the pool runs dry, it is retracted and resumes from the cache (the positions
    already scored are not asked for again; it may be retracted more than once): each logprob must
    be reported once, not once per attempt."""
    from collections import deque

    import numpy as np

    from services.scheduler.batcher import Batcher, Limits
    from services.scheduler.kv import KVManager
    from services.scheduler.policy import POLICIES
    from services.scheduler.request import Req
    from services.scheduler.step_io import take_prompt_logprobs, with_extras
    from services.worker.sampling.batch import score_positions
    from shared.messages.common import SamplingParams, f32, i32
    from shared.messages.to_scheduler import StepOutput

    b = Batcher(KVManager(200, 64, 1), POLICIES["fcfs"](), Limits(64, 64, 32))
    scorer = Req(rid="s", replica=b"t", prompt=list(range(100, 165)),
                 params=SamplingParams(max_new_tokens=0, temperature=0.0, prompt_logprobs_from=20))
    decoders = [Req(rid=f"d{i}", replica=b"t", prompt=[300 + i, 400 + i], params=SamplingParams(max_new_tokens=12))
                for i in range(20)]
    running, waiting = [], deque(decoders)
    done, hog = [], None

    def step():
        b.new_token_ratio = 0.1  # optimistic decode reservations at their floor: admission packs the pool
        s = b.build(running, waiting)
        if s is None:
            return False
        s.msg = with_extras(s, None)  # the grammar backend is needed only for constrained requests
        out = StepOutput(step_id=s.step_id, next_ids=i32([5] * len(s.reqs)))
        if s.msg.score_rows:  # what the worker returns: one value per scored position
            _, targets, counts = score_positions(s.msg)
            out = StepOutput(step_id=s.step_id, next_ids=out.next_ids, prompt_logprob_counts=i32(counts),
                             prompt_logprobs=f32(np.arange(len(targets), dtype=np.float32)))
        take_prompt_logprobs(s, out)
        for r, n, sample in zip(s.reqs, s.extend, s.emits):
            if n > 1 or not r.output:
                b.kv.cache_prefix(r)
            if not sample:
                continue
            r.pending -= 1  # (its token is known now: what the scheduler does when a step's results arrive)
            if r.params.max_new_tokens:
                r.output.append(5)
            if len(r.output) >= r.params.max_new_tokens:
                running.remove(r)
                b.kv.release(r)
                done.append(r)
        return True

    step()
    waiting.append(scorer)
    for _ in range(200):
        if hog is None and scorer in running and scorer.to_compute == 1:
            hog = b.kv.slots.alloc(None, b.kv.slots.num_free)  # decode outgrew its estimate: no room
        if not step():
            break
        if hog and scorer not in running:
            b.kv.slots.free(hog)
            hog = []
    print("DBG", scorer.retractions, scorer in done, len(scorer.prompt_logprobs), scorer.cached_tokens)
    assert scorer.retractions >= 1 and scorer in done
    assert len(scorer.prompt_logprobs) == len(scorer.prompt) - 20
