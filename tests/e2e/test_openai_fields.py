"""The OpenAI surface beyond plain generation, against ``banyan serve`` (demo model) with the official
``openai`` client: the field policy (every ignored field accepted, every refused one a 400 naming it),
the validation gaps (roles, missing content, strict types, an empty body), ``param`` on every 400,
each refusal logged once, unserved endpoints, ``/tokenizer_info``, ``continuous_usage_stats``."""

from __future__ import annotations

import json
import uuid

import openai
import pytest
import requests

from services.tokenizer.http import fields
from tests.support import Server

MODEL = "banyan-demo"
BASE = {fields.CHAT: {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        fields.COMPLETIONS: {"prompt": "hi", "max_tokens": 2},
        fields.RESPONSES: {"input": "hi", "max_output_tokens": 2}}


@pytest.fixture(scope="module")
def server(demo_dir, tmp_path_factory):
    s = Server(None, tmp_path_factory.mktemp("openai_fields") / "server.log")
    yield s
    assert s.stop() == 0, s.log_text()[-3000:]


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.http_url + "/v1", api_key="none", max_retries=0, timeout=60) as c:
        yield c


def post(server, endpoint: str, body, headers=None) -> requests.Response:
    path = fields.ENDPOINTS.get(endpoint, endpoint)
    data = body if isinstance(body, bytes) else json.dumps(body)
    return requests.post(server.http_url + path, data=data, timeout=60,
                         headers={"Content-Type": "application/json", **(headers or {})})


def _cases(policy: fields.Policy):
    return [pytest.param(e, r, id=f"{e}-{r.name}") for r in fields.RULES if r.policy is policy for e in r.endpoints]


@pytest.mark.parametrize("endpoint, rule", _cases(fields.Policy.IGNORED))
def test_ignored_fields_are_accepted(server, endpoint, rule):
    r = post(server, endpoint, {**BASE[endpoint], rule.name: rule.example})
    assert r.status_code == 200, r.text[:400]


@pytest.mark.parametrize("endpoint, rule", _cases(fields.Policy.REFUSED))
def test_refused_fields_are_a_400_naming_them(server, endpoint, rule):
    r = post(server, endpoint, {**BASE[endpoint], rule.name: rule.example})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == rule.name, r.text[:400]
    assert err["message"].startswith(rule.name) and rule.note in err["message"], err


def test_nulls_are_not_given(server):
    body = {**BASE[fields.CHAT], "stream": None, "n": None, "user": None, "skip_special_tokens": None,
            "stream_options": None, "logit_bias": None}
    r = post(server, fields.CHAT, body)
    assert r.status_code == 200, r.text[:400]


GAPS = {  # name → (endpoint, body, param, words in the message)
    "role wizard": (fields.CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role", "'user'"),
    "no content": (fields.CHAT, {"messages": [{"role": "user"}]}, "messages.0.content", "content is required"),
    "max_tokens a string": (fields.CHAT, {**BASE[fields.CHAT], "max_tokens": "10"}, "max_tokens", "valid integer"),
    "empty object": (fields.CHAT, {}, "messages", "messages: is required"),
    "empty completions body": (fields.COMPLETIONS, {}, "prompt", "prompt: is required"),
    "empty responses body": (fields.RESPONSES, {}, "input", "input: is required"),
    "max_tokens -1": (fields.CHAT, {**BASE[fields.CHAT], "max_tokens": -1}, "max_tokens", "max_tokens must be"),
    "n 0": (fields.CHAT, {**BASE[fields.CHAT], "n": 0}, "n", "n must be"),
    "temperature": (fields.CHAT, {**BASE[fields.CHAT], "temperature": -1}, "temperature", "temperature must be"),
    "top_p": (fields.COMPLETIONS, {**BASE[fields.COMPLETIONS], "top_p": 2}, "top_p", "top_p must be"),
    "stop": (fields.COMPLETIONS, {**BASE[fields.COMPLETIONS], "stop": ["x"] * 17}, "stop", "stop has 17"),
    "seed": (fields.CHAT, {**BASE[fields.CHAT], "seed": -1}, "seed", "seed must be"),
    "top_logprobs": (fields.CHAT, {**BASE[fields.CHAT], "logprobs": True, "top_logprobs": 50}, "top_logprobs",
                     "top_logprobs must be"),
    "prompt too long": (fields.CHAT, {**BASE[fields.CHAT], "messages": [{"role": "user", "content": "hi " * 5000}]},
                        "messages", "context window"),
    "logit_bias key": (fields.CHAT, {**BASE[fields.CHAT], "logit_bias": {"x": 10}}, "logit_bias", "not a token id"),
    "logit_bias id": (fields.CHAT, {**BASE[fields.CHAT], "logit_bias": {"999999": 1}}, "logit_bias", "vocabulary"),
    "min_tokens": (fields.CHAT, {**BASE[fields.CHAT], "min_tokens": 5}, "min_tokens", "min_tokens must be in"),
    "repetition_penalty": (fields.COMPLETIONS, {**BASE[fields.COMPLETIONS], "repetition_penalty": 0},
                           "repetition_penalty", "repetition_penalty must be"),
    "responses role": (fields.RESPONSES, {"input": [{"role": "wizard", "content": "x"}]}, "input.0.role",
                       "input[0].role must be"),
    "responses image": (fields.RESPONSES, {"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
                        "input.0.content.0", "only text parts"),
}


@pytest.mark.parametrize("name", list(GAPS))
def test_every_400_names_its_field(server, name):
    endpoint, body, param, words = GAPS[name]
    r = post(server, endpoint, body)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == param and words in err["message"], (name, r.text[:500])
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize("endpoint, need", [(fields.CHAT, "messages"), (fields.COMPLETIONS, "prompt"),
                                            (fields.RESPONSES, "input")])
def test_no_body_names_what_is_missing(server, endpoint, need):
    r = requests.post(server.http_url + fields.ENDPOINTS[endpoint], timeout=30)
    err = r.json()["error"]
    assert r.status_code == 400 and "body is missing" in err["message"] and need in err["message"], r.text
    assert err["param"] == need


def test_each_refusal_is_logged_once_with_its_request_id(server):
    rid = "reject-" + uuid.uuid4().hex
    r = post(server, fields.CHAT, {**BASE[fields.CHAT], "max_tokens": "10"}, headers={"X-Request-Id": rid})
    assert r.status_code == 400 and r.headers["X-Request-Id"] == rid
    rid2 = "reject-" + uuid.uuid4().hex
    assert post(server, fields.CHAT, {**BASE[fields.CHAT], "temperature": -1},
                headers={"X-Request-Id": rid2}).status_code == 400
    for want, param in ((rid, "max_tokens"), (rid2, "temperature")):
        lines = [x for x in server.log_records()
                 if x.get("event") == "request_rejected" and x.get("request_id") == want]
        assert len(lines) == 1 and lines[0]["level"] == "warning" and lines[0]["param"] == param, lines
        assert lines[0]["status"] == 400 and param in lines[0]["reason"]


@pytest.mark.parametrize("path, status, words", [
    ("/v1/embeddings", 501, "embeddings"),
    ("/v1/audio/speech", 501, "audio"),
    ("/v1/images/generations", 501, "images"),
    ("/v1/nothing", 404, "no such endpoint"),
])
def test_unserved_endpoints_say_so(server, client, path, status, words):
    r = post(server, path, {"model": MODEL, "input": "hi"})
    err = r.json()["error"]
    assert r.status_code == status and words in err["message"] and path in err["message"], r.text
    if path == "/v1/embeddings":
        with pytest.raises(openai.APIStatusError) as e:
            client.embeddings.create(model=MODEL, input="hi")
        assert e.value.status_code == 501 and "embeddings" in e.value.message


def test_tokenizer_info_in_vllms_shape(server, demo_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(demo_dir)
    info = requests.get(server.http_url + "/tokenizer_info", timeout=30).json()
    assert info["tokenizer_class"] == type(tok).__name__ and info["eos_token"] == tok.eos_token
    assert info["chat_template"] == tok.chat_template
    assert isinstance(info["model_max_length"], int)
    toks = requests.post(server.http_url + "/tokenize", json={"prompt": info["eos_token"],
                                                              "add_special_tokens": False}, timeout=30).json()
    assert len(toks["tokens"]) == 1  # (lm-eval's remote tokenizer finds the EOS id this way)


def test_continuous_usage_stats_on_every_chunk(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Count"}], max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    with_choices = [c for c in chunks if c.choices and (c.choices[0].delta.content or c.choices[0].finish_reason)]
    assert with_choices and all(c.usage is not None for c in with_choices)
    counts = [c.usage.completion_tokens for c in with_choices]
    assert counts == sorted(counts) and counts[-1] == 6, counts
    assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in with_choices)
    assert chunks[-1].usage.completion_tokens == 6 and not chunks[-1].choices  # (include_usage's last chunk)


def _grpc_tokens(server, text: str, **sampling) -> list[int]:
    from shared.proto.banyan.v1 import generation_pb2 as pb
    from shared.proto.banyan.v1 import generation_pb2_grpc as pb_grpc

    with server.channel() as ch:
        req = pb.GenerateRequest(text=text, sampling_params=pb.SamplingParams(**sampling))
        return [t for r in pb_grpc.GenerationServiceStub(ch).Generate(req, timeout=60) for t in r.token_ids]


def test_sampling_extensions_reach_the_engine(server, client):
    """logit_bias, min_tokens, repetition_penalty, stop_token_ids, ignore_eos from the body (vLLM's names)
    give the tokens gRPC gives with the same settings (the engine's own tests check those against HF)."""
    forced = 7
    out = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=4, temperature=0,
                                    extra_body={"logit_bias": {str(forced): 100}, "ignore_eos": True})
    assert out.choices[0].text == requests.post(server.http_url + "/detokenize", json={"tokens": [forced] * 4},
                                                timeout=30).json()["prompt"]
    for extra, grpc_kw in (({"repetition_penalty": 1.6, "ignore_eos": True}, dict(repetition_penalty=1.6,
                                                                                   ignore_eos=True)),
                           ({"min_tokens": 3, "logit_bias": {"3": 100}},
                            dict(min_tokens=3, logit_bias={3: 100.0}))):
        want = _grpc_tokens(server, "Once upon", max_tokens=6, temperature=0.0, **grpc_kw)
        r = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=6, temperature=0, extra_body=extra)
        assert r.usage.completion_tokens == len(want), (extra, want)
        assert r.choices[0].text == requests.post(server.http_url + "/detokenize", json={"tokens": want},
                                                  timeout=30).json()["prompt"], extra


def test_grpc_refusals_are_logged_too(server):
    from shared.proto.banyan.v1 import generation_pb2 as pb
    from shared.proto.banyan.v1 import generation_pb2_grpc as pb_grpc
    import grpc

    rid = "grpc-reject-" + uuid.uuid4().hex
    with server.channel() as ch:
        with pytest.raises(grpc.RpcError) as e:
            list(pb_grpc.GenerationServiceStub(ch).Generate(
                pb.GenerateRequest(text="hi", sampling_params=pb.SamplingParams(temperature=-1)),
                metadata=[("x-request-id", rid)], timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    lines = [x for x in server.log_records() if x.get("event") == "request_rejected" and x.get("request_id") == rid]
    assert len(lines) == 1 and lines[0]["code"] == "INVALID_ARGUMENT" and "temperature" in lines[0]["reason"], lines
