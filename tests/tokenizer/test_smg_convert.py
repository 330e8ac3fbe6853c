"""SMG's engine API at the edge, without servers: request fields → Banyan's request (and the
refusals, each naming its field), chunks → SMG's chunk / complete messages, the tokenizer bundle."""

from __future__ import annotations

import hashlib
import io
import json
import zipfile
from importlib.metadata import version

import pytest
from google.protobuf.struct_pb2 import Struct
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from shared.errors import InvalidArgument
from shared.messages.common import Constraint, FinishReason
from services.tokenizer.generation import Chunk, TokenLogprob, Usage
from services.tokenizer.smg import bundle, convert
from services.tokenizer.smg.servicer import SmgServicer


def request(**kw) -> pb.GenerateRequest:
    sp = dict(temperature=0.7, top_p=0.9, top_k=-1, min_p=0.0, repetition_penalty=1.0, n=1,
              skip_special_tokens=True, spaces_between_special_tokens=True)
    sp.update(kw.pop("sp", {}))
    kw.setdefault("logprob_start_len", -1)
    return pb.GenerateRequest(request_id="r1", tokenized=pb.TokenizedInput(input_ids=[5, 6, 7]),
                              sampling_params=pb.SamplingParams(**sp), **kw)


def test_the_pinned_proto_and_every_rpc_served():
    assert version("smg-grpc-proto") == "0.4.28"
    rpcs = {m.name for m in pb.DESCRIPTOR.services_by_name["SglangScheduler"].methods}
    assert rpcs == {"Generate", "Embed", "HealthCheck", "Abort", "GetModelInfo", "GetServerInfo", "GetLoads",
                    "FlushCache", "StartProfile", "StopProfile", "GetTokenizer", "SubscribeKvEvents",
                    "LoadLoRAAdapter", "UnloadLoRAAdapter", "ListLoadedLoRAAdapters"}
    assert all(name in vars(SmgServicer) for name in rpcs), "an RPC falls back to the stub's generic UNIMPLEMENTED"


def test_sampling_fields_map_onto_banyans():
    r = request(sp=dict(max_new_tokens=9, stop=["\n"], stop_token_ids=[3], ignore_eos=True, n=3,
                        presence_penalty=0.5, frequency_penalty=-0.5, json_schema='{"type":"object"}'),
                return_logprob=True, top_logprobs_num=2)
    convert.check_supported(r)
    s = convert.sampling(r)
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.n, s.stop, s.stop_token_ids, s.ignore_eos) == \
        (9, pytest.approx(0.7), pytest.approx(0.9), -1, 3, ["\n"], [3], True)
    assert (s.presence_penalty, s.frequency_penalty, s.logprobs, s.top_logprobs) == (0.5, -0.5, True, 2)
    assert convert.constraint(r).kind == "json_schema"
    assert convert.prompt(r).token_ids == [5, 6, 7]
    unset = convert.sampling(request(sp=dict(n=0)))
    assert unset.max_tokens is None and unset.n == 1 and unset.top_logprobs is None
    assert convert.constraint(request(sp=dict(ebnf_grammar='root ::= "a"'))).kind == "ebnf"
    assert convert.constraint(request(sp=dict(regex="[0-9]+"))).value == "[0-9]+"
    assert convert.constraint(request()) is None


@pytest.mark.parametrize("kw, field", [
    (dict(mm_inputs=pb.MultimodalInputs(image_urls=["http://x/a.png"])), "mm_inputs"),
    (dict(input_embeds=[0.1]), "input_embeds"),
    (dict(lora_id="adapter"), "lora_id"),
    (dict(disaggregated_params=pb.DisaggregatedParams(bootstrap_host="h")), "disaggregated_params"),
    (dict(return_hidden_states=True), "return_hidden_states"),
    (dict(custom_logit_processor="x"), "custom_logit_processor"),
    (dict(token_ids_logprob=[1]), "token_ids_logprob"),
])
def test_what_banyan_cannot_do_is_refused_naming_the_field(kw, field):
    with pytest.raises(InvalidArgument, match=field.replace(".", r"\.")):
        convert.check_supported(request(**kw))


def test_custom_params_are_refused():
    params = Struct()
    params.update({"x": 1})
    with pytest.raises(InvalidArgument, match=r"sampling_params\.custom_params"):
        convert.check_supported(request(sp=dict(custom_params=params)))


def test_defaults_are_not_refused():
    convert.check_supported(request(sp=dict(repetition_penalty=0.0, stream_interval=1),
                                    return_logprob=False, logprob_start_len=0))


def test_stream_interval_is_honoured():
    convert.check_supported(request(sp=dict(stream_interval=4)))
    assert convert.sampling(request(sp=dict(stream_interval=4))).stream_interval == 4
    assert convert.sampling(request(sp=dict(stream_interval=0))).stream_interval is None  # (0: SGLang's default)
    assert convert.sampling(request()).stream_interval is None


def test_prompt_logprobs_prefill_only_and_logit_processors_map_onto_banyans():
    r = request(sp=dict(max_new_tokens=0, repetition_penalty=1.2, min_new_tokens=2, logit_bias={"5": 1.5, "7": -3}),
                return_logprob=True, logprob_start_len=1, top_logprobs_num=3)
    convert.check_supported(r)
    s = convert.sampling(r)
    assert (s.max_tokens, s.prompt_logprobs_start, s.prompt_top_logprobs) == (0, 1, 3)
    assert (s.repetition_penalty, s.min_tokens, s.logit_bias) == (pytest.approx(1.2), 2, {5: 1.5, 7: -3.0})
    # no prompt logprobs: not asked (return_logprob false, logprob_start_len -1) or a start past the prompt
    for kw in (dict(return_logprob=False, logprob_start_len=0), dict(return_logprob=True),
               dict(return_logprob=True, logprob_start_len=3)):
        s = convert.sampling(request(**kw))
        assert s.prompt_logprobs_start is None and s.prompt_top_logprobs is None
    s = convert.sampling(request(sp=dict(repetition_penalty=0.0)))  # (0: SGLang's "unset")
    assert s.repetition_penalty is None and s.min_tokens is None and s.logit_bias is None
    with pytest.raises(InvalidArgument, match=r"sampling_params\.logit_bias: 'x5' is not a token id"):
        convert.sampling(request(sp=dict(logit_bias={"x5": 1.0})))


def test_input_logprobs_as_sglang_sends_them():
    lps = [TokenLogprob(5, None, []), TokenLogprob(6, -1.25, [(6, -1.25), (9, -2.0)])]
    b = convert.Branch()
    b.prompt_lps = lps
    first = Chunk(0, [11], "a", prompt_logprobs=lps)
    inp = convert.stream_chunk("r", first, b, 2, top=True).chunk.input_logprobs
    assert list(inp.token_ids) == [5, 6]
    assert [t.HasField("value") for t in inp.token_logprobs] == [False, True]
    assert inp.token_logprobs[1].value == -1.25
    assert [list(t.token_ids) for t in inp.top_logprobs] == [[], [6, 9]]
    last = Chunk(0, [], "", FinishReason.LENGTH, Usage(2, 1, 0))
    done = convert.complete("r", last, b, streamed=True, top=False).complete
    assert list(done.input_logprobs.token_ids) == [5, 6] and not done.input_logprobs.top_logprobs
    assert not convert.stream_chunk("r", last, b, 2, top=True).chunk.HasField("input_logprobs")


def test_bad_values_name_smg_fields():
    with pytest.raises(InvalidArgument, match="tokenized.input_ids"):
        convert.prompt(pb.GenerateRequest(request_id="x"))
    e = convert.smg_names(InvalidArgument("sampling_params.max_tokens=9 … and sampling_params.top_logprobs must"))
    assert str(e) == "sampling_params.max_new_tokens=9 … and top_logprobs_num must"
    e = convert.smg_names(InvalidArgument("sampling_params.min_tokens must be in [0, max_tokens=2]"))
    assert str(e).startswith("sampling_params.min_new_tokens must")


def test_chunks_and_completions():
    lps = [TokenLogprob(11, -0.5, [(11, -0.5), (12, -1.5)]), TokenLogprob(13, -0.25, [(13, -0.25), (2, -2.0)])]
    b = convert.Branch()
    first = Chunk(1, [11, 13], "ab", logprobs=lps)
    b.ids += first.token_ids
    b.lps += lps
    msg = convert.stream_chunk("r", first, b, 7, top=True)
    assert msg.WhichOneof("response") == "chunk" and msg.request_id == "r"
    c = msg.chunk
    assert (list(c.token_ids), c.prompt_tokens, c.completion_tokens, c.index) == ([11, 13], 7, 2, 1)
    assert list(c.output_logprobs.token_ids) == [11, 13]
    assert list(c.output_logprobs.top_logprobs[1].token_ids) == [13, 2]
    last = Chunk(1, [3], "", FinishReason.STOP, Usage(7, 3, 4), matched_stop_token_id=3,
                 logprobs=[TokenLogprob(3, -0.1, [(3, -0.1), (9, -3.0)])])
    b.ids += last.token_ids
    b.lps += last.logprobs
    done = convert.complete("r", last, b, streamed=False, top=False).complete
    assert (list(done.output_ids), done.finish_reason, done.prompt_tokens, done.completion_tokens) == \
        ([11, 13, 3], "stop", 7, 3)
    assert (done.cached_tokens, done.matched_token_id, done.index) == (4, 3, 1)
    assert list(done.output_logprobs.token_ids) == [11, 13, 3] and not done.output_logprobs.top_logprobs
    streamed = convert.complete("r", last, b, streamed=True, top=True).complete
    assert list(streamed.output_ids) == [3] and len(streamed.output_logprobs.top_logprobs) == 1
    end = Chunk(0, [], "", FinishReason.STOP, Usage(7, 1, 0), matched_stop="\n")
    by_string = convert.complete("r", end, b, True, False)
    assert by_string.complete.WhichOneof("matched_stop") == "matched_stop_str"
    assert by_string.complete.matched_stop_str == "\n" and not by_string.complete.HasField("output_logprobs")


def test_tokenizer_bundle(tmp_path):
    (tmp_path / "tokenizer.json").write_text('{"model": {}}')
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ x }}"}))
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 4096)  # never shipped
    data, digest = bundle.tokenizer_zip(tmp_path)
    assert hashlib.sha256(data).hexdigest() == digest
    assert sorted(zipfile.ZipFile(io.BytesIO(data)).namelist()) == ["config.json", "tokenizer.json",
                                                                     "tokenizer_config.json"]
    assert bundle.tokenizer_zip(tmp_path) == (data, digest), "the same files give the same bytes"
    parts = bundle.chunks(b"x" * (bundle.CHUNK_BYTES * 2 + 1))
    assert [len(p) for p in parts] == [bundle.CHUNK_BYTES, bundle.CHUNK_BYTES, 1]
    with pytest.raises(FileNotFoundError):
        bundle.tokenizer_zip(tmp_path / "nothing")


def test_structural_tags_become_constraints():
    """The gateway's tool-call grammar: xgrammar's format as it is, SGLang's older one converted."""
    new = json.dumps({"type": "structural_tag", "format": {"type": "const_string", "value": "x"}})
    assert convert.constraint(request(sp=dict(structural_tag=new))) == Constraint("structural_tag", value=new)
    old = {"type": "structural_tag", "triggers": ["<tool_call>"],
           "structures": [{"begin": '<tool_call>{"name": "f", "arguments": ', "schema": {"type": "object"},
                           "end": "}</tool_call>"}]}
    c = convert.constraint(request(sp=dict(structural_tag=json.dumps(old))))
    fmt = json.loads(c.value)["format"]
    assert c.kind == "structural_tag" and fmt["type"] == "triggered_tags" and fmt["triggers"] == ["<tool_call>"]
    assert fmt["tags"][0]["begin"] == old["structures"][0]["begin"]
    for bad in ("{}", "not json", "[]"):
        with pytest.raises(InvalidArgument, match=r"sampling_params\.structural_tag"):
            convert.constraint(request(sp=dict(structural_tag=bad)))
