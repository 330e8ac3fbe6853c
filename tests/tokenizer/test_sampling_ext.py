"""Validation of the sampling extensions (``services/tokenizer/sampling_ext.py`` through
``validation.sampling``), without servers: the fields they become and each refusal naming its field."""

from __future__ import annotations

import pytest

from shared.errors import InvalidArgument
from shared.messages.to_tokenizer import ModelInfo
from services.tokenizer.validation import SamplingRequest, sampling

INFO = ModelInfo(model="m", architecture="LlamaForCausalLM", vocab_size=100, context_length=64, pool_size=1000,
                 max_running_requests=8, eos_token_ids=[2], device="cpu", dtype="float32")


def params(**kw):
    return sampling(SamplingRequest(**kw), 10, INFO, "p.")


def test_fields_and_defaults():
    plain = params()
    assert (plain.prompt_logprobs_from, plain.logit_bias, plain.min_new_tokens, plain.repetition_penalty) == \
        (-1, {}, 0, 1.0) and not plain.processed and not plain.scores_prompt
    p = params(max_tokens=0, prompt_logprobs_start=0, prompt_top_logprobs=5)
    assert (p.max_new_tokens, p.prompt_logprobs_from, p.prompt_top_logprobs, p.first_scored) == (0, 0, 5, 1)
    p = params(logit_bias={3: 250.0, 4: -1000, 5: 0.0, 6: 1.5}, min_tokens=2, repetition_penalty=1.2, max_tokens=5)
    assert p.logit_bias == {3: 100.0, 4: -100.0, 6: 1.5}  # clamped; a zero bias dropped
    assert (p.min_new_tokens, p.repetition_penalty, p.processed) == (2, 1.2, True)
    assert not params(repetition_penalty=1.0, min_tokens=0, logit_bias={}).processed
    # a session turn: the start counts from its own input, after the session's tokens
    turn = sampling(SamplingRequest(prompt_logprobs_start=3), 30, INFO, "p.", context=20)
    assert turn.prompt_logprobs_from == 23


@pytest.mark.parametrize("kw,words", [
    (dict(max_tokens=-1), "p.max_tokens must be >= 0"),
    (dict(prompt_logprobs_start=-1), "p.prompt_logprobs_start must be >= 0"),
    (dict(prompt_logprobs_start=10), "p.prompt_logprobs_start=10 is past the prompt's last token"),
    (dict(prompt_top_logprobs=1), "p.prompt_top_logprobs needs prompt_logprobs_start"),
    (dict(prompt_logprobs_start=0, prompt_top_logprobs=21), "p.prompt_top_logprobs must be in [0, 20]"),
    (dict(logit_bias={"5": 1.0}), "p.logit_bias: key '5' is not a token id"),
    (dict(logit_bias={100: 1.0}), "p.logit_bias: token id 100 is out of the vocabulary [0, 100)"),
    (dict(logit_bias={5: float("inf")}), "p.logit_bias[5] must be a finite number"),
    (dict(logit_bias={i: 1.0 for i in range(1025)}), "p.logit_bias has 1025 entries"),
    (dict(min_tokens=6, max_tokens=5), "p.min_tokens must be in [0, max_tokens=5]"),
    (dict(min_tokens=-1), "p.min_tokens must be in [0, "),
    (dict(repetition_penalty=0.0), "p.repetition_penalty must be in (0, 2]"),
    (dict(repetition_penalty=float("nan")), "p.repetition_penalty must be in (0, 2]"),
])
def test_refusals_name_the_field(kw, words):
    with pytest.raises(InvalidArgument) as e:
        params(**kw)
    assert words in str(e.value)
