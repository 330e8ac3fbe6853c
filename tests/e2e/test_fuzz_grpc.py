"""Property-based fuzz of the public gRPC API (hypothesis) against a live server: random
GenerateRequest / Score / Tokenize / Detokenize / Abort messages (edge-case numbers, odd text,
random grammars), random bytes and byte-mutated valid messages sent as the serialized request.

Every call ends OK or INVALID_ARGUMENT: never INTERNAL / UNKNOWN (a bug), never a hang; no
service logs an error; afterwards the server is alive and serves a normal request. Examples are
derandomized (the same every run: CI stays reproducible) and their counts kept small for CI time;
every generation asks for at most 8 tokens."""

from __future__ import annotations

import json

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support import Server
from shared.proto.banyan.v1 import generation_pb2 as pb
from shared.proto.banyan.v1 import generation_pb2_grpc as pb_grpc

SERVICE = "/banyan.v1.GenerationService/"
UNARY = ("Tokenize", "Detokenize", "GetModelInfo", "Abort", "GetLoad", "Score")
FUZZ = settings(max_examples=100, deadline=None, database=None, derandomize=True,
                suppress_health_check=list(HealthCheck))
TIMEOUT = 60  # a call that takes longer hangs


@pytest.fixture(scope="module")
def server(demo_dir, tmp_path_factory):
    s = Server(None, tmp_path_factory.mktemp("fuzz-grpc") / "server.log", env={"OMP_NUM_THREADS": "1"})
    yield s
    assert s.stop() == 0, s.log_text()[-3000:]


@pytest.fixture(scope="module")
def channel(server):
    with server.channel() as ch:
        yield ch


# ---- strategies: ``valid`` draws only what the API accepts (the request must succeed), otherwise
# edge cases and garbage are mixed into every field (the request may be refused) ----------------------
floats = st.one_of(st.floats(width=32), st.sampled_from([0.0, -0.0, 1e-45, 1e-6, 0.5, 1.0, 2.0, 3e38, -1.0]))
u32 = st.one_of(st.integers(0, 8), st.integers(0, 2**32 - 1), st.sampled_from([1999, 2000, 2**31, 2**32 - 1]))
texts = st.one_of(st.text(max_size=40), st.sampled_from(["", "\x00", "<|im_end|>", "<|im_start|>system\n", "🙂" * 9,
                                                         "a" * 300, "\u200b\ufeff", "{", "\\"]))
words = st.text(min_size=1, max_size=24) | st.sampled_from(["<|im_end|>", "🙂" * 9, "\x00", "{", "\u200b"])
json_values = st.recursive(st.none() | st.booleans() | st.integers(-5, 5) | st.text(max_size=5),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                                     max_size=3), max_leaves=8)
GRAMMARS = {  # kind → (valid, anything)
    "regex": (st.sampled_from(["[a-z]{1,4}", "(a|b)*c", ".{0,3}", "x?", "[0-9]+"]),
              texts | st.sampled_from(["(((", "a{5,2}", "\\", "[z-a]"])),
    "json_schema": (st.sampled_from(['{"type": "object"}', '{"type": "string", "maxLength": 3}', '{"enum": [1, "a"]}',
                                     '{"type": "array", "items": {"type": "integer"}}', "true"]),
                    texts | json_values.map(json.dumps) | st.sampled_from(
                        ['{"type": "nope"}', '{"$ref": "#/nowhere"}', '{"type": "array", "minItems": 5, "maxItems": 2}'])),
    "ebnf": (st.sampled_from(['root ::= "a" | "b"', 'root ::= [a-c]+', 'root ::= "x" root | "y"']),
             texts | st.sampled_from(["root ::= root", 'start ::= "a"', "root ::= [", ""])),
}
SAMPLING = (  # field → (valid values, anything)
    ("temperature", st.floats(0, 2), floats), ("top_p", st.floats(0.01, 1), floats), ("min_p", st.floats(0, 1), floats),
    ("presence_penalty", st.floats(-2, 2), floats), ("frequency_penalty", st.floats(-2, 2), floats),
    ("top_k", st.integers(-1, 50), st.integers(-(2**31), 2**31 - 1)),
    ("seed", st.integers(0, 2**63 - 1), st.integers(0, 2**64 - 1)), ("n", st.integers(1, 3), u32),
    ("top_logprobs", st.integers(0, 5), u32), ("skip_special_tokens", st.booleans(), st.booleans()))


def pick(valid: bool, good, anything):
    return good if valid else st.one_of(good, anything)


@st.composite
def sampling(draw, valid: bool) -> pb.SamplingParams:
    # max_tokens always set and small when valid: generations stay short
    kw = {"max_tokens": draw(pick(valid, st.sampled_from([1, 2, 4, 8]), st.sampled_from([0, 10**6, 2**32 - 1])))}
    for name, good, anything in SAMPLING:
        if draw(st.booleans()):
            kw[name] = draw(pick(valid, good, anything))
    return pb.SamplingParams(
        stop=draw(pick(valid, st.lists(words, max_size=2), st.lists(texts, max_size=20))),
        stop_token_ids=draw(pick(valid, st.lists(st.integers(0, 1999), max_size=3), st.lists(u32, max_size=3))),
        ignore_eos=draw(st.booleans()), logprobs=draw(st.booleans()), **kw)


@st.composite
def prompts(draw, valid: bool, kinds=("text", "token_ids", "chat")) -> dict:
    kind = draw(st.sampled_from(kinds) if valid else st.sampled_from(kinds) | st.none())
    if kind == "text":
        return {"text": draw(pick(valid, words, texts))}
    if kind == "token_ids":
        return {"token_ids": pb.TokenIds(ids=draw(pick(valid, st.lists(st.integers(0, 1999), min_size=1, max_size=24),
                                                      st.lists(u32, max_size=24) | st.just([5] * 5000))))}
    if kind is None:
        return {}
    roles = pick(valid, st.sampled_from(["user", "system", "assistant", "tool"]),
                 st.sampled_from(["", "us er", "user\n", "a" * 70]) | texts)
    msgs = draw(pick(valid, st.lists(st.tuples(roles, words), min_size=1, max_size=3),
                     st.lists(st.tuples(roles, texts), max_size=3)))
    add = draw(st.none() | st.booleans())
    return {"chat": pb.ChatInput(messages=[pb.ChatMessage(role=r, content=c) for r, c in msgs],
                                 **({} if add is None else {"add_generation_prompt": add}))}


@st.composite
def constraints(draw, valid: bool) -> dict:
    kind = draw(st.sampled_from([None, None, "regex", "json_schema", "ebnf", "choice", "json_object"]))
    if kind == "choice":
        return {"choice": pb.Choices(choices=draw(pick(valid, st.lists(words.filter(lambda w: "\x00" not in w),
                                                                     min_size=1, max_size=4),
                                                       st.lists(texts, max_size=4))))}
    if kind == "json_object":
        return {"json_object": draw(st.booleans())}
    return {kind: draw(pick(valid, *GRAMMARS[kind]))} if kind else {}


def generate_requests(valid: bool):
    ids = pick(valid, st.just(""), st.text(max_size=8) | st.just("r" * 300))
    return st.builds(lambda rid, p, s, c, salt: pb.GenerateRequest(request_id=rid, sampling_params=s, cache_salt=salt,
                                                                   **p, **c),
                     ids, prompts(valid), sampling(valid), constraints(valid), ids)


score_requests = st.builds(lambda p, conts: pb.ScoreRequest(continuations=conts, **p), prompts(False),
                           st.lists(words, min_size=1, max_size=4) | st.lists(texts, max_size=4) | st.just(["a"] * 65))
tokenize_requests = st.builds(lambda p, add: pb.TokenizeRequest(**p, **({} if add is None else {"add_special_tokens": add})),
                              prompts(False, ("text", "chat")), st.none() | st.booleans())
detokenize_requests = st.builds(lambda ids, skip: pb.DetokenizeRequest(
    token_ids=ids, **({} if skip is None else {"skip_special_tokens": skip})),
    st.lists(st.integers(0, 1999), max_size=24) | st.lists(u32, max_size=24), st.none() | st.booleans())


# ---- checks ------------------------------------------------------------------------------------
def _ok_or_invalid(what: str, fn) -> None:
    try:
        fn()
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (what, e.code(), e.details())
        assert e.details(), what


def _stream(channel: grpc.Channel, raw: bytes) -> None:
    list(channel.unary_stream(SERVICE + "Generate")(raw, timeout=TIMEOUT))


def _unary(channel: grpc.Channel, method: str, raw: bytes) -> None:
    channel.unary_unary(SERVICE + method)(raw, timeout=TIMEOUT)


def _generate(stub, req: pb.GenerateRequest) -> None:
    resps = list(stub.Generate(req, timeout=TIMEOUT))
    n = req.sampling_params.n if req.sampling_params.HasField("n") else 1
    last = {r.index: r for r in resps if r.finish_reason}
    assert sorted(last) == list(range(n)), resps[-1:]  # every branch ended with a reason
    for i, r in last.items():
        tokens = sum(len(x.token_ids) for x in resps if x.index == i)
        assert r.usage.completion_tokens == tokens <= req.sampling_params.max_tokens, r


@FUZZ
@given(req=generate_requests(valid=True))
def test_fuzz_valid_generate_succeeds(stub, req):
    """Any combination of valid values is served (a grammar the compiler refuses aside)."""
    try:
        _generate(stub, req)
    except grpc.RpcError as e:
        assert req.WhichOneof("constraint") in ("regex", "json_schema", "ebnf"), (repr(req)[:600], e.details())
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and e.details().startswith("invalid "), e.details()


@FUZZ
@given(req=generate_requests(valid=False))
def test_fuzz_generate(stub, req):
    _ok_or_invalid(repr(req)[:600], lambda: _generate(stub, req))


@FUZZ
@given(req=score_requests)
def test_fuzz_score(stub, req):
    _ok_or_invalid(repr(req)[:600], lambda: stub.Score(req, timeout=TIMEOUT))


@FUZZ
@given(tok=tokenize_requests, detok=detokenize_requests)
def test_fuzz_tokenize_detokenize(stub, tok, detok):
    _ok_or_invalid(repr(tok)[:600], lambda: stub.Tokenize(tok, timeout=TIMEOUT))
    _ok_or_invalid(repr(detok)[:600], lambda: stub.Detokenize(detok, timeout=TIMEOUT))
    _ok_or_invalid("abort", lambda: stub.Abort(pb.AbortRequest(request_id=tok.text[:300]), timeout=TIMEOUT))


@settings(FUZZ, max_examples=150)
@given(raw=st.binary(max_size=200), method=st.sampled_from(("Generate",) + UNARY))
def test_fuzz_random_bytes(channel, raw, method):
    send = (lambda: _stream(channel, raw)) if method == "Generate" else (lambda: _unary(channel, method, raw))
    _ok_or_invalid(f"{method} {raw!r}", send)


@settings(FUZZ, max_examples=150)
@given(req=generate_requests(valid=False), flips=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1,
                                             max_size=4), cut=st.none() | st.integers(0, 10**6))
def test_fuzz_mutated_generate_bytes(channel, req, flips, cut):
    raw = bytearray(req.SerializeToString())
    for pos, value in flips:
        if raw:
            raw[pos % len(raw)] = value
    if cut is not None and raw:
        del raw[cut % len(raw):]
    _ok_or_invalid(f"Generate {bytes(raw)!r}", lambda: _stream(channel, bytes(raw)))


def test_still_serving_after_fuzz(server, stub, channel):
    """Runs last in this module: the server survived everything above."""
    assert server.proc.poll() is None
    health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    out = list(stub.Generate(pb.GenerateRequest(text="still alive", sampling_params=pb.SamplingParams(
        max_tokens=3, ignore_eos=True)), timeout=60))
    assert out[-1].usage.completion_tokens == 3
    errors = [r for r in server.log_records() if r.get("level") in ("error", "critical")]
    assert not errors, errors[:5]
