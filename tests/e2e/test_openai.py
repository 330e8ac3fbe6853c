"""The OpenAI-compatible HTTP API of ``banyan serve`` (demo model, 2 tokenizer replicas, an API key),
driven by the official ``openai`` client: chat and text completions, streaming, n, logprobs, stop,
seeds, usage and prefix-cache hits, errors, the API key on both fronts, client disconnects."""

from __future__ import annotations

import http.client
import json
import re
import subprocess
import sys
import time
import uuid

import grpc
import jsonschema
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.support import ROOT, Server
from shared.proto.banyan.v1 import generation_pb2 as pb
from shared.proto.banyan.v1 import generation_pb2_grpc as pb_grpc

KEY = "sk-test-" + uuid.uuid4().hex
MODEL = "banyan-demo"
GREEDY = dict(temperature=0.0, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def server(demo_dir, tmp_path_factory):
    s = Server(None, tmp_path_factory.mktemp("openai") / "server.log", "--num-tokenizers", "2", "--api-key", KEY)
    yield s
    assert s.stop() == 0, s.log_text()[-3000:]


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.http_url + "/v1", api_key=KEY, max_retries=0, timeout=60) as c:
        yield c


AUTH = [("authorization", f"Bearer {KEY}")]


def raw(server, method: str, path: str, body=None, key: str | None = KEY, headers=None):
    """One plain HTTP request: (status, headers, parsed JSON or text)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=60)
    h = {"Content-Type": "application/json", **(headers or {})}
    if key is not None:
        h["Authorization"] = f"Bearer {key}"
    conn.request(method, path, body=None if body is None else json.dumps(body), headers=h)
    resp = conn.getresponse()
    data = resp.read().decode()
    conn.close()
    try:
        return resp.status, resp.headers, json.loads(data)
    except json.JSONDecodeError:
        return resp.status, resp.headers, data


def chat(client, content="Hello there", **kw):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], **kw)


def wait_idle(stub, timeout=15.0) -> pb.GetLoadResponse:
    deadline = time.monotonic() + timeout
    while True:
        load = stub.GetLoad(pb.GetLoadRequest(), metadata=AUTH)
        if (load.num_running_requests == 0 and load.num_waiting_requests == 0) or time.monotonic() > deadline:
            return load
        time.sleep(0.05)


def test_models_health_openapi(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    assert raw(server, "GET", "/health", key=None)[:3:2] == (200, {"status": "ok"})
    status, _, spec = raw(server, "GET", "/openapi.json", key=None)
    assert status == 200
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/models", "/tokenize", "/detokenize", "/health"):
        assert path in spec["paths"], path
    card = client.models.retrieve(MODEL).model_extra
    assert card["vocab_size"] == stub_info(server).vocab_size and card["max_model_len"] > 0


def stub_info(server) -> pb.GetModelInfoResponse:
    with server.channel() as ch:
        return pb_grpc.GenerationServiceStub(ch).GetModelInfo(pb.GetModelInfoRequest(), metadata=AUTH, timeout=30)


def test_docs_served_without_a_cdn(server):
    """/docs is Swagger UI whose every asset comes from this server (open without the API key)."""
    status, _, page = raw(server, "GET", "/docs", key=None)
    assert status == 200 and "swagger-ui" in page
    links = re.findall(r'(?:src|href)="([^"]+)"', page)
    assert links and all(u.startswith("/docs/assets/") for u in links), links
    assert "https://" not in page and "http://" not in page
    for url in links:
        conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=60)
        conn.request("GET", url)
        resp = conn.getresponse()
        body = resp.read()
        assert resp.status == 200 and len(body) > 1000, (url, resp.status)
    bundle = [u for u in links if u.endswith(".js")]
    assert bundle, links
    # the asset mount is not a way around the API key
    assert raw(server, "GET", "/docs/assets/../../v1/models", key=None)[0] in (401, 404)
    assert raw(server, "GET", "/v1/models", key=None)[0] == 401


def test_chat_matches_grpc_and_streams_the_same_text(client, stub):
    r = chat(client, max_tokens=16, **GREEDY)
    c = r.choices[0]
    assert r.object == "chat.completion" and r.model == MODEL and r.id.startswith("chatcmpl-")
    assert c.message.role == "assistant" and c.finish_reason == "length"
    req = pb.GenerateRequest(chat=pb.ChatInput(messages=[pb.ChatMessage(role="user", content="Hello there")]),
                             sampling_params=pb.SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    assert c.message.content == "".join(x.text for x in stub.Generate(req, metadata=AUTH, timeout=60))
    assert (r.usage.completion_tokens, r.usage.total_tokens) == (16, r.usage.prompt_tokens + 16)
    chunks = list(chat(client, max_tokens=16, stream=True, stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == c.message.content
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    u = chunks[-1].usage  # the last chunk: usage only
    assert chunks[-1].choices == [] and (u.prompt_tokens, u.completion_tokens) == (r.usage.prompt_tokens, 16)
    assert all(ch.usage is None for ch in chunks[:-1]) and len(chunks) > 3


def test_chat_text_parts_and_roles(server, client):
    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2)
    status, _, tok = raw(server, "POST", "/tokenize", {"messages": [msgs[0], {"role": "user", "content": "Hi\nthere"}]})
    assert status == 200 and r.usage.prompt_tokens == tok["count"] > 8


def test_completions_text_token_ids_and_stream(server, client):
    r = client.completions.create(model=MODEL, prompt="Once upon a time", **GREEDY)
    assert r.object == "text_completion" and r.usage.completion_tokens == 16  # OpenAI's default max_tokens
    _, _, tok = raw(server, "POST", "/tokenize", {"prompt": "Once upon a time"})
    by_ids = client.completions.create(model=MODEL, prompt=tok["tokens"], **GREEDY)
    assert by_ids.choices[0].text == r.choices[0].text and by_ids.usage.prompt_tokens == tok["count"]
    chunks = list(client.completions.create(model=MODEL, prompt="Once upon a time", stream=True, **GREEDY))
    assert "".join(ch.choices[0].text for ch in chunks) == r.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_completions_prompt_batch_with_n(server, client):
    prompts = ["Once upon a time", "The king"]
    r = client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=6, **GREEDY)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]  # prompt i, branch j → i * n + j
    texts = [c.text for c in r.choices]
    assert texts[0] == texts[1] and texts[2] == texts[3] and texts[0] != texts[2]  # greedy: n copies
    assert client.completions.create(model=MODEL, prompt="The king", max_tokens=6, **GREEDY).choices[0].text == texts[2]
    counts = [raw(server, "POST", "/tokenize", {"prompt": p})[2]["count"] for p in prompts]
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (sum(counts), 24)  # each prompt counted once


def test_n3_streamed_and_not(client):
    r = chat(client, n=3, max_tokens=12, temperature=1.0, seed=3, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1, 2] and r.usage.completion_tokens == 36
    assert len({c.message.content for c in r.choices}) == 3
    texts = {0: "", 1: "", 2: ""}
    for ch in chat(client, n=3, max_tokens=12, temperature=1.0, seed=3, stream=True, extra_body={"ignore_eos": True}):
        for c in ch.choices:
            texts[c.index] += c.delta.content or ""
    assert sorted(texts.values()) == sorted(c.message.content for c in r.choices)


def test_chat_logprobs(client):
    r = chat(client, max_tokens=5, logprobs=True, top_logprobs=2, **GREEDY)
    lp = r.choices[0].logprobs
    assert lp is not None and isinstance(lp.content, list)
    assert len(lp.content) == 5
    for t in lp.content:
        assert len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
        assert t.logprob <= 0 and all(x.logprob <= 0 for x in t.top_logprobs)
        assert t.token == t.top_logprobs[0].token and t.logprob == pytest.approx(t.top_logprobs[0].logprob)  # greedy
    assert b"".join(bytes(t.bytes) for t in lp.content).decode(errors="replace") == r.choices[0].message.content


def test_completion_logprobs(client):
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4, logprobs=2, **GREEDY)
    lp = r.choices[0].logprobs
    assert lp is not None
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    assert all(x <= 0 for x in lp.token_logprobs) and all(len(d) <= 2 for d in lp.top_logprobs)
    assert lp.text_offset[0] == 0 and "".join(lp.tokens) == r.choices[0].text


@pytest.mark.parametrize("as_list", [False, True])
def test_stop(client, as_list):
    full = chat(client, max_tokens=40, **GREEDY).choices[0].message.content
    stop = full[len(full) // 2: len(full) // 2 + 3]
    assert stop.strip(), f"degenerate sample text {full!r}"
    r = chat(client, max_tokens=40, stop=[stop, "\x00never"] if as_list else stop, **GREEDY)
    c = r.choices[0]
    assert c.finish_reason == "stop" and c.message.content == full[: full.index(stop)]
    assert c.model_extra["stop_reason"] == stop and r.usage.completion_tokens < 40
    streamed = "".join(ch.choices[0].delta.content or "" for ch in
                       chat(client, max_tokens=40, stop=stop, stream=True, **GREEDY) if ch.choices)
    assert streamed == c.message.content


def test_seed_reproducible(client):
    def run(seed):
        return chat(client, max_tokens=16, temperature=1.0, seed=seed, extra_body={"ignore_eos": True}
                    ).choices[0].message.content

    assert run(11) == run(11) != run(12)
    assert run(2**63 + 11) == run(11) and run(2**64 - 1) == run(2**63 - 1)  # uint64 seeds fold to 63 bits


def test_usage_and_cached_tokens(client):
    prompt = f"{uuid.uuid4().hex} " + " ".join(f"word{i}" for i in range(150))
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    assert first.usage.prompt_tokens == second.usage.prompt_tokens > 150
    c1, c2 = first.usage.prompt_tokens_details.cached_tokens, second.usage.prompt_tokens_details.cached_tokens
    assert c1 < 10 and c2 >= first.usage.prompt_tokens // 2, (c1, c2)


BAD = {  # (endpoint, body) → 400 with a message naming the problem
    "max_tokens -1": ("chat", {"max_tokens": -1}, "max_tokens"),
    "negative temperature": ("chat", {"temperature": -1}, "temperature"),
    "top_p > 1": ("completions", {"top_p": 1.5}, "top_p"),
    "n 0": ("chat", {"n": 0}, "n must be"),
    "wrong type": ("chat", {"max_tokens": "many"}, "max_tokens"),
    "unknown field": ("chat", {"tools": [{"type": "function"}]}, "tools"),
    "empty messages": ("chat", {"messages": []}, "messages"),
    "image part": ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
                   "only text"),
    "top_logprobs without logprobs": ("chat", {"top_logprobs": 2}, "logprobs"),
    "top_logprobs too many": ("chat", {"logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    "prompt too long": ("completions", {"prompt": [5] * 5000}, "context"),
    "token id out of vocab": ("completions", {"prompt": [1, 10**6]}, "vocabulary"),
    "empty prompt": ("completions", {"prompt": ""}, "empty"),
    "too many stops": ("completions", {"stop": ["x"] * 17}, "stop"),
    "suffix": ("completions", {"suffix": "x"}, "suffix"),
    "json_schema without schema": ("chat", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x"}}}, "schema is required"),
    "two constraints": ("completions", {"regex": "[ab]+", "ebnf": "root ::= \"a\""}, "at most one"),
    "regex that does not compile": ("completions", {"regex": "(ab"}, "regex"),
    "streamed bad regex": ("completions", {"regex": "(ab", "stream": True}, "regex"),
    "unknown response_format": ("chat", {"response_format": {"type": "xml"}}, "response_format.type"),
    "seed over uint64": ("chat", {"seed": 2**64}, "seed"),
    "negative seed": ("chat", {"seed": -1}, "seed must be in"),
    "stream_options without stream": ("chat", {"stream_options": {"include_usage": True}}, "stream"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_is_400(client, name):
    kind, extra, needle = BAD[name]
    base = ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2} if kind == "chat"
            else {"prompt": "hi", "max_tokens": 2})
    body = {**base, **extra}
    create = client.chat.completions.create if kind == "chat" else client.completions.create
    with pytest.raises(openai.BadRequestError) as e:
        create(model=MODEL, **{k: v for k, v in body.items() if k in ("messages", "prompt")},
               extra_body={k: v for k, v in body.items() if k not in ("messages", "prompt")})
    err = e.value.body
    assert err["type"] == "invalid_request_error" and needle in err["message"], err


SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "pattern": "^[A-Z][a-z]{0,11}$"}, "age": {"type": "integer", "minimum": 0,
                                                                     "maximum": 120},
                   "role": {"enum": ["admin", "user", "guest"]}},
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}


def test_structured_output(client, stub):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    c = chat(client, "A person:", max_tokens=120, temperature=0.0, response_format=fmt).choices[0]
    req = pb.GenerateRequest(chat=pb.ChatInput(messages=[pb.ChatMessage(role="user", content="A person:")]),
                             json_schema=json.dumps(SCHEMA),
                             sampling_params=pb.SamplingParams(max_tokens=120, temperature=0.0))
    assert c.message.content == "".join(r.text for r in stub.Generate(req, metadata=AUTH, timeout=60))  # one path
    regex = client.completions.create(model=MODEL, prompt="Code:", max_tokens=20, temperature=1.0,
                                      extra_body={"regex": r"\d{3}-[a-z]{2,4}"}).choices[0].text
    choice = "".join(ch.choices[0].text for ch in client.completions.create(
        model=MODEL, prompt="Answer:", max_tokens=20, stream=True, extra_body={"choice": ["yes", "no", "maybe"]}))
    assert chat(client, max_tokens=2, response_format={"type": "text"}).choices[0].finish_reason
    jsonschema.validate(json.loads(c.message.content), SCHEMA)
    assert c.finish_reason == "stop" and re.fullmatch(r"\d{3}-[a-z]{2,4}", regex) and choice in ("yes", "no", "maybe")


def test_malformed_bodies_and_unknown_route(server):
    def post(body: str, content_type: str) -> tuple[int, str]:
        conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=30)
        conn.request("POST", "/v1/completions", body=body,
                     headers={"Authorization": f"Bearer {KEY}", "Content-Type": content_type})
        resp = conn.getresponse()
        out = resp.status, json.loads(resp.read())["error"]["message"]
        conn.close()
        return out

    assert post("{not json", "application/json") == (400, "invalid JSON body: Expecting property name enclosed "
                                                           "in double quotes")
    status, message = post('{"prompt": "hi"}', "application/x-www-form-urlencoded")
    assert status == 400 and "Content-Type: application/json" in message
    status, message = post('{"prompt": "\\ud800", "max_tokens": 1}', "application/json")  # a lone surrogate
    assert status == 400 and "Unicode" in message, message
    status, _, body = raw(server, "GET", "/v1/nothing")
    assert status == 404 and body["error"]["message"]


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert e.value.body["code"] == "model_not_found" and "gpt-4" in e.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


def test_api_key_on_http_and_grpc(server):
    for key in (None, "wrong", KEY + "x"):
        status, headers, body = raw(server, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 1}, key=key)
        assert status == 401 and body["error"]["type"] == "authentication_error"
        assert headers["WWW-Authenticate"] == "Bearer"
    with openai.OpenAI(base_url=server.http_url + "/v1", api_key="wrong", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
    assert raw(server, "GET", "/health", key=None)[0] == 200
    assert raw(server, "GET", "/metrics", key=None)[0] == 200
    with server.channel() as ch:
        stub = pb_grpc.GenerationServiceStub(ch)
        for md in ((), [("authorization", "Bearer wrong")]):
            with pytest.raises(grpc.RpcError) as e:
                stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=md)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(pb.GenerateRequest(text="hi"), metadata=md))
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=AUTH).model == MODEL
        h = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""))
        assert h.status == health_pb2.HealthCheckResponse.SERVING


def _open_stream(server, rid: str, stream: bool, key: str | None = KEY) -> http.client.HTTPConnection:
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=60)
    body = {"prompt": f"a long story {rid}", "max_tokens": 3000, "ignore_eos": True, "stream": stream}
    headers = {"Content-Type": "application/json", "X-Request-Id": rid}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers=headers)
    return conn


def _running(stub, timeout=15.0) -> None:
    deadline = time.monotonic() + timeout
    while stub.GetLoad(pb.GetLoadRequest(), metadata=AUTH).num_running_requests == 0:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.02)


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_aborts(server, stub, stream):
    assert wait_idle(stub).num_running_requests == 0
    rid = f"gone-{uuid.uuid4().hex[:8]}"
    conn = _open_stream(server, rid, stream)
    if stream:
        resp = conn.getresponse()
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
        assert resp.readline().startswith(b"data: {")
    _running(stub)
    conn.sock.shutdown(2)
    conn.close()
    assert wait_idle(stub).num_running_requests == 0
    time.sleep(0.2)
    stages = [r.get("stage") for r in server.log_records() if r.get("request_id") == rid]
    assert "cancelled" in stages and "sent" not in stages, stages


def test_duplicate_request_id_is_409(server, client, stub):
    conn = _open_stream(server, "dup-http", True)
    try:
        assert conn.getresponse().status == 200
        with pytest.raises(openai.ConflictError):
            client.completions.create(model=MODEL, prompt="hi", max_tokens=2,
                                      extra_headers={"X-Request-Id": "dup-http"})
    finally:
        conn.close()
    wait_idle(stub)


def test_tokenize_detokenize_and_metrics(server):
    text = "Grüße, 世界! 🙂 tokens"
    status, _, tok = raw(server, "POST", "/tokenize", {"prompt": text, "add_special_tokens": False})
    assert status == 200 and tok["count"] == len(tok["tokens"]) == len(tok["token_strs"]) > 0
    assert raw(server, "POST", "/detokenize", {"tokens": tok["tokens"]})[2] == {"prompt": text}
    status, _, body = raw(server, "POST", "/detokenize", {"tokens": [10**7]})
    assert status == 400 and "vocabulary" in body["error"]["message"]
    status, headers, metrics = raw(server, "GET", "/metrics", key=None)
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    assert 'banyan_http_requests_total{endpoint="/tokenize",status="200"}' in metrics
    assert "banyan_http_requests_in_flight" in metrics


def test_both_replicas_serve_http(server):
    for i in range(24):  # a new connection each: the kernel spreads them over the replicas
        assert raw(server, "POST", "/v1/completions", {"prompt": f"story {i}", "max_tokens": 1})[0] == 200
    pids = {r["pid"] for r in server.log_records()
            if r.get("stage") == "received" and r.get("api") == "completions"}
    assert len(pids) == 2


def test_banyan_bench_openai_backend(server, tmp_path):
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, "-m", "banyan.cli", "bench", "--backend", "openai", "--target", server.http_url,
                        "--model", MODEL, "--api-key", KEY, "--dataset", "random", "--num-prompts", "8",
                        "--input-len", "8:32", "--output-len", "4:8", "--vocab-size", "1500", "--max-concurrency", "4",
                        "--no-progress", "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(out.read_text())
    assert res["completed"] == 8 and res["failed"] == 0 and res["total_output_tokens"] >= 32
