"""The worker's logit processors (``services/worker/sampling/processors.py``) against HF
transformers' own LogitsProcessors on the same logits: repetition penalty, min new tokens, and
logit bias (HF's SequenceBiasLogitsProcessor with one-token sequences); several rows in one batch,
each with its own settings, rows without any left alone, and the state updated by sampled tokens."""

from __future__ import annotations

import numpy as np
import torch
from transformers import (LogitsProcessorList, MinNewTokensLengthLogitsProcessor, RepetitionPenaltyLogitsProcessor,
                          SequenceBiasLogitsProcessor)

from shared.messages.common import SamplingParams, i32
from shared.messages.to_worker import NewReq
from services.worker.sampling.processors import LogitProcessors

V = 50
EOS = [3, 7]


def new_req(row: int, prompt: list[int], output: list[int] = (), **params) -> NewReq:
    return NewReq(rid=f"r{row}", row=row, params=SamplingParams(stop_token_ids=EOS, **params), prompt_len=len(prompt),
                  prompt_ids=i32(prompt), output_ids=i32(list(output)))


def test_each_row_matches_its_hf_processor_in_one_batch():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, V, generator=g) * 3
    prompts = [[1, 2, 9, 9, 40], [5, 6, 3], [8, 8, 8, 11], [12, 13]]
    outputs = [[20, 2], [4], [], [7]]
    procs = LogitProcessors(V, torch.device("cpu"))
    bias = {3: -100.0, 17: 5.5, 49: -2.0}
    reqs = [new_req(0, prompts[0], outputs[0], repetition_penalty=1.3),
            new_req(1, prompts[1], outputs[1], min_new_tokens=3),
            new_req(2, prompts[2], outputs[2], logit_bias=bias),
            NewReq(rid="plain", row=3, params=SamplingParams())]
    for nr in reqs:
        procs.add_row(nr)
    seq_end = np.array([len(p) + len(o) for p, o in zip(prompts, outputs)])
    got = logits.clone()
    procs.apply(got, [0, 1, 2, 3], [nr.params for nr in reqs], seq_end)

    ids = [torch.tensor([p + o]) for p, o in zip(prompts, outputs)]
    hf = [RepetitionPenaltyLogitsProcessor(1.3),
          MinNewTokensLengthLogitsProcessor(len(prompts[1]), 3, EOS),
          SequenceBiasLogitsProcessor({(t,): b for t, b in bias.items()})]
    for k, proc in enumerate(hf):
        want = LogitsProcessorList([proc])(ids[k], logits[k:k + 1].clone())[0]
        assert torch.equal(got[k], want), k
    assert torch.equal(got[3], logits[3])
    assert torch.isinf(got[1, EOS]).all() and got[2, 3] == logits[2, 3] - 100


def test_min_new_tokens_mask_lifts_after_enough_tokens():
    procs = LogitProcessors(V, torch.device("cpu"))
    nr = new_req(0, [1, 2, 4], min_new_tokens=2)
    procs.add_row(nr)
    hf = MinNewTokensLengthLogitsProcessor(3, 2, EOS)
    for out in ([], [5], [5, 6], [5, 6, 8]):
        logits = torch.randn(1, V)
        got = logits.clone()
        procs.apply(got, [0], [nr.params], np.array([3 + len(out)]))
        assert torch.equal(got, hf(torch.tensor([[1, 2, 4] + out]), logits.clone())), out


def test_repetition_mask_follows_sampled_tokens():
    """Tokens recorded after sampling (on the device) are penalized from the next step on, like HF's
    processor seeing them in input_ids."""
    procs = LogitProcessors(V, torch.device("cpu"))
    nr = new_req(0, [1, 2], repetition_penalty=0.7)
    procs.add_row(nr)
    seq = [1, 2]
    hf = RepetitionPenaltyLogitsProcessor(0.7)
    for tok in (30, 31, 30, 44):
        logits = torch.randn(1, V)
        got = logits.clone()
        procs.apply(got, [0], [nr.params], np.array([len(seq)]))
        assert torch.equal(got, hf(torch.tensor([seq]), logits.clone()))
        procs.record([0], torch.tensor([tok]))
        seq.append(tok)
    procs.drop_row(0)
    logits = torch.randn(1, V)
    got = logits.clone()
    procs.apply(got, [0], [nr.params], np.array([len(seq)]))
    assert torch.equal(got, logits)  # (a released row: nothing applied)


def test_the_batch_sampler_applies_them_only_to_rows_that_ask(monkeypatch):
    """A step whose rows use no processor never enters them; a mixed step hands them its rows, and
    the plain row's draw is what it is alone."""
    from shared.messages.to_worker import ForwardBatch
    from services.worker.sampling.batch import BatchSampler
    from services.worker.sampling.draw import TokenSampler

    bs = BatchSampler(TokenSampler(), V, torch.device("cpu"))
    bs.admit(NewReq(rid="plain", row=0, params=SamplingParams(temperature=0.0)))
    calls = []
    real = LogitProcessors.apply
    monkeypatch.setattr(LogitProcessors, "apply", lambda self, *a: calls.append(a[1]) or real(self, *a))

    def step(rows: list[int]):
        n = len(rows)
        b = ForwardBatch(step_id=0, new_reqs=[], released_rows=[], rows=i32(rows), prefix_lens=i32([4] * n),
                         extend_lens=i32([1] * n), emits=i32([1] * n), input_ids=i32([1] * n), out_slots=i32([1] * n))
        logits = torch.arange(n * V, dtype=torch.float32).view(n, V) % 17
        return bs.sample(b, logits, np.ones(n, dtype=bool)).ids.tolist()

    alone = step([0])
    assert calls == []
    bs.admit(new_req(1, [1, 2, 3, 4], logit_bias={0: 100.0}))
    both = step([0, 1])
    assert calls == [[0, 1]] and both == [alone[0], 0]
    bs.release(1)
    calls.clear()
    assert step([0]) == alone and calls == []
