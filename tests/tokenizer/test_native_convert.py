"""SGLang's ``/generate`` body → items (services/tokenizer/http/native/convert.py) and chunks →
outputs (results.py), without a server: per-prompt fields, refusals by name, SGLang's field names in
validation errors, finish reasons and the input log-prob layout."""

from __future__ import annotations

import pytest

from shared.errors import InvalidArgument
from shared.messages.common import FinishReason, SamplingParams
from shared.messages.to_scheduler import GenerateReq
from services.tokenizer.generation import Chunk, TokenLogprob, Usage
from services.tokenizer.http.convert import TokenTexts
from services.tokenizer.http.native import convert
from services.tokenizer.http.native import protocol as api
from services.tokenizer.http.native.results import Output
from services.tokenizer.text import TextProcessor
from services.tokenizer.validation import Prepared


def items(**body):
    return convert.items(api.GenerateRequest(**body))


def test_single_batch_and_per_prompt_fields():
    its, batch = items(text="hi", sampling_params={"max_new_tokens": 3, "temperature": 0.5, "stop": "x"})
    assert not batch and len(its) == 1
    s = its[0].sampling
    assert (s.max_tokens, s.temperature, s.stop) == (3, 0.5, ["x"]) and its[0].max_new_tokens == 3
    its, batch = items(input_ids=[[1, 2], [3]], sampling_params=[{"n": 2}, {"n": 2}], rid=["a", "b"],
                       return_logprob=[True, False], logprob_start_len=[0, 1], top_logprobs_num=2)
    assert batch and [i.rid for i in its] == ["a", "b"] and [i.prompt.token_ids for i in its] == [[1, 2], [3]]
    assert [(i.return_logprob, i.logprob_start, i.top_logprobs) for i in its] == [(True, 0, 2), (False, -1, 0)]
    assert its[0].sampling.max_tokens == convert.DEFAULT_MAX_NEW_TOKENS and its[0].sampling.n == 2
    its, _ = items(text="a", sampling_params={"max_new_tokens": 0, "logit_bias": {"7": -2.0},
                                              "min_new_tokens": 0, "sampling_seed": 9, "regex": "[ab]+"})
    assert its[0].prefill_only and its[0].sampling.logit_bias == {7: -2.0} and its[0].sampling.seed == 9
    assert its[0].constraint.kind == "regex" and its[0].constraint.value == "[ab]+"


@pytest.mark.parametrize("body, words", [
    (dict(text="a", image_data="x"), ["image_data", "multimodal"]),
    (dict(text="a", return_hidden_states=True), ["return_hidden_states"]),
    (dict(text="a", bogus=1), ["bogus", "unrecognized"]),
    (dict(text="a", sampling_params={"beam_width": 2}), ["sampling_params.beam_width"]),
    (dict(text="a", sampling_params={"no_stop_trim": True}), ["no_stop_trim"]),
    (dict(text="a", sampling_params={"seed": 1, "sampling_seed": 2}), ["seed", "sampling_seed"]),
    (dict(text="a", sampling_params={"logit_bias": {"tok": 1.0}}), ["logit_bias", "'tok'"]),
    (dict(text=["a", "b"], sampling_params=[{}]), ["sampling_params", "2 prompts"]),
    (dict(text=["a", "b"], rid=["x", "x"]), ["rid", "differ"]),
    (dict(text=[]), ["empty batch"]),
    (dict(text="a", logprob_start_len=-2, return_logprob=True), ["logprob_start_len"]),
])
def test_refusals_name_the_field(body, words):
    with pytest.raises(InvalidArgument) as e:
        items(**body)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_validation_messages_in_sglang_names():
    msg = convert.sglang_names(InvalidArgument("sampling_params.max_tokens must be >= 0; sampling_params.top_logprobs "
                                               "in [0, 20]; sampling_params.min_tokens; request_id too long")).args[0]
    assert msg == ("sampling_params.max_new_tokens must be >= 0; top_logprobs_num in [0, 20]; "
                   "sampling_params.min_new_tokens; rid too long")


@pytest.fixture(scope="module")
def texts(demo_dir) -> TokenTexts:
    return TokenTexts(TextProcessor(demo_dir))


def _output(texts, ids: list[int], **body) -> Output:
    item = items(input_ids=ids, **body)[0][0]
    p = Prepared(GenerateReq(rid="r", input_ids=ids, params=SamplingParams()), [], True)
    return Output(item, p, "r", texts, True, [])


def test_outputs_finish_reasons_and_logprob_layout(texts):
    o = _output(texts, [5, 6, 7, 8], return_logprob=True, logprob_start_len=1, top_logprobs_num=1,
                sampling_params={"max_new_tokens": 2})
    plps = [TokenLogprob(7, -1.5, [(9, -0.5)]), TokenLogprob(8, -2.5, [(8, -2.5)])]  # positions 2, 3
    o.add(Chunk(0, [10], "a", logprobs=[TokenLogprob(10, -0.25, [(10, -0.25)])], prompt_logprobs=plps))
    o.add(Chunk(0, [11], "b", FinishReason.LENGTH, Usage(4, 2, 3), logprobs=[TokenLogprob(11, float("-inf"), [])]))
    body = o.body(0.0)
    m = body["meta_info"]
    assert body["text"] == "ab" and body["output_ids"] == [10, 11]
    assert m["finish_reason"] == {"type": "length", "length": 2} and (m["prompt_tokens"], m["cached_tokens"]) == (4, 3)
    assert [e[:2] for e in m["input_token_logprobs"]] == [[None, 6], [-1.5, 7], [-2.5, 8]]
    assert m["input_token_logprobs"][1][2] == texts(7)
    assert m["input_top_logprobs"] == [None, [[-0.5, 9, texts(9)]], [[-2.5, 8, texts(8)]]]
    assert [e[:2] for e in m["output_token_logprobs"]] == [[-0.25, 10], [None, 11]]  # -inf: null
    stop = _output(texts, [5], sampling_params={"stop": ["zz"]})
    stop.add(Chunk(0, [12], "x", FinishReason.STOP, Usage(1, 1, 0), matched_stop="zz"))
    assert stop.finish_reason() == {"type": "stop", "matched": "zz"} and "input_token_logprobs" not in stop.meta(0)
    tok = _output(texts, [5])
    tok.add(Chunk(0, [3], "", FinishReason.STOP, Usage(1, 1, 0), matched_stop_token_id=3))
    assert tok.finish_reason() == {"type": "stop", "matched": 3}
    gone = _output(texts, [5])
    gone.add(Chunk(0, [], "", FinishReason.ABORT, Usage(1, 0, 0)))
    assert gone.finish_reason()["type"] == "abort" and gone.body(0.0, 3)["index"] == 3
