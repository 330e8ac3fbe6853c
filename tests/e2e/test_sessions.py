"""Sessions and pinned prefixes end to end on the demo model, with a 3,000-token KV pool.

- A session's next turn finds every earlier token's KV in the cache (all but the last token
  generated, whose KV no step has computed) after a burst of unrelated traffic that filled the
  pool twice; the same conversation without a session finds nothing. The turn's prompt is the
  session's tokens + the new messages rendered as a continuation: its output equals a plain
  request for those exact token ids.
- Branching (two turns continuing one), a stop string's cut kept in the session, expiry, close,
  capacity (FAILED_PRECONDITION / 400), unknown sessions (NOT_FOUND / 404), the HTTP routes.
- PinPrefix keeps a prefix cached through the same burst; the pinned-token cap, UnpinPrefix, TTL.
- Every bad input of the new fields and RPCs: INVALID_ARGUMENT / 400 naming the field.
- ``bn.session``: a session-backed program state, forks branching it.
"""

from __future__ import annotations

import json
import random
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

import banyan as bn
from tests.support import Server
from shared.proto.banyan.v1 import generation_pb2 as pb

POOL = 3000
PINNED = 1200


@pytest.fixture(scope="module")
def server(demo_dir, tmp_path_factory):
    s = Server(None, tmp_path_factory.mktemp("sessions") / "server.log", "--max-total-tokens", str(POOL),
               "--max-pinned-tokens", str(PINNED))
    yield s
    assert s.stop() == 0, s.log_text()[-3000:]


def chat(*pairs: tuple[str, str], add: bool = True) -> pb.ChatInput:
    return pb.ChatInput(messages=[pb.ChatMessage(role=r, content=c) for r, c in pairs], add_generation_prompt=add)


def gen(stub, max_tokens=16, **kw) -> tuple[list[int], str, pb.GenerateResponse]:
    req = pb.GenerateRequest(sampling_params=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                               **kw.pop("sp", {})), **kw)
    resps = list(stub.Generate(req, timeout=120))
    return [t for r in resps for t in r.token_ids], "".join(r.text for r in resps), resps[-1]


def load(stub) -> pb.GetLoadResponse:
    return stub.GetLoad(pb.GetLoadRequest(), timeout=30)


def burst(stub, seed: int, tokens: int = 2 * POOL + 500) -> None:
    """Unrelated prompts (random ids) adding up to more than twice the pool."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(10, 1990) for _ in range(500)] for _ in range(-(-tokens // 500))]
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda p: gen(stub, 1, token_ids=pb.TokenIds(ids=p)), prompts))


def ids_of(stub, c: pb.ChatInput) -> list[int]:
    return list(stub.Tokenize(pb.TokenizeRequest(chat=c), timeout=30).token_ids)


def test_session_turn_hits_the_cache_after_a_burst_that_fills_the_pool_twice(stub):
    first = [("system", "You answer briefly."), ("user", "Tell me about the river.")]
    then = ("user", "And what about the mountains?")
    sid = stub.OpenSession(pb.OpenSessionRequest(ttl_seconds=300)).session_id
    out1, text1, last1 = gen(stub, 24, chat=chat(*first), session_id=sid, request_id="river")
    plain1 = gen(stub, 24, chat=chat(*first), cache_salt="plain")  # the same conversation, no session
    assert plain1[0] == out1
    before = load(stub)
    burst(stub, 1)
    after = load(stub)
    assert after.evicted_tokens - before.evicted_tokens >= POOL  # the burst went through the whole pool
    assert after.num_sessions == 1 and after.session_tokens == last1.usage.prompt_tokens + len(out1)

    out2, _, last2 = gen(stub, 16, chat=chat(then), session_id=sid)
    history = last1.usage.prompt_tokens + len(out1)
    # every earlier token but the last one generated (its KV was never computed) came from the cache
    assert last2.usage.cached_tokens == history - 1, (last2.usage, history)
    plain2 = gen(stub, 16, chat=chat(*first, ("assistant", text1), then), cache_salt="plain")[2]
    assert plain2.usage.cached_tokens <= 2, plain2.usage  # without the session: evicted (a BOS at most)
    print(f"session turn 2: {last2.usage.cached_tokens}/{history} earlier tokens cached "
          f"({last2.usage.cached_tokens / (history - 1):.0%} of their KV); without a session "
          f"{plain2.usage.cached_tokens}/{plain2.usage.prompt_tokens}")

    # the prompt was the session's tokens + the new message rendered as a continuation
    head = ids_of(stub, chat(("system", ""), add=False))
    full = ids_of(stub, chat(("system", ""), then))
    assert full[:len(head)] == head
    expected = ids_of(stub, chat(*first)) + out1 + full[len(head):]
    assert last2.usage.prompt_tokens == len(expected)
    assert gen(stub, 16, token_ids=pb.TokenIds(ids=expected), cache_salt="check")[0] == out2
    assert stub.CloseSession(pb.CloseSessionRequest(session_id=sid)).tokens == len(expected) + len(out2)


def test_branches_continue_one_turn_and_share_it(stub):
    sid = stub.OpenSession(pb.OpenSessionRequest(ttl_seconds=300, capacity=1000)).session_id
    out, _, root = gen(stub, 12, chat=chat(("user", "Pick a number.")), session_id=sid, request_id="root")
    history = root.usage.prompt_tokens + len(out)
    branches = [gen(stub, 8, chat=chat(("user", f"Now double it, take {i}.")), session_id=sid,
                    session_parent="root", request_id=f"branch-{i}")[1:] for i in range(2)]
    assert branches[0][1].usage.cached_tokens == history - 1
    assert branches[1][1].usage.cached_tokens >= history - 1  # (and what it shares with branch-0's input)
    # a third turn continues the latest one (branch-1), not root
    _, _, latest = gen(stub, 4, chat=chat(("user", "Thanks.")), session_id=sid)
    assert latest.usage.cached_tokens >= branches[1][1].usage.prompt_tokens
    tokens = stub.CloseSession(pb.CloseSessionRequest(session_id=sid)).tokens
    grown = [b[1].usage.prompt_tokens + b[1].usage.completion_tokens - history for b in branches]
    assert tokens == history + sum(grown) + latest.usage.prompt_tokens + latest.usage.completion_tokens \
        - (branches[1][1].usage.prompt_tokens + branches[1][1].usage.completion_tokens)


def test_a_stop_string_cut_is_what_the_session_keeps(stub):
    probe = stub.OpenSession(pb.OpenSessionRequest()).session_id
    _, text, _ = gen(stub, 24, chat=chat(("user", "Say something long.")), session_id=probe)
    stub.CloseSession(pb.CloseSessionRequest(session_id=probe))
    stop = text.strip()[len(text.strip()) // 2:][:3]
    assert stop
    sid = stub.OpenSession(pb.OpenSessionRequest()).session_id
    got, _, last = gen(stub, 24, chat=chat(("user", "Say something long.")), session_id=sid, sp={"stop": [stop]})
    assert last.finish_reason == pb.FINISH_REASON_STOP and last.matched_stop == stop and len(got) < 24
    _, _, nxt = gen(stub, 2, chat=chat(("user", "More.")), session_id=sid)
    head = ids_of(stub, chat(("system", ""), add=False))
    delta = len(ids_of(stub, chat(("system", ""), ("user", "More.")))) - len(head)
    assert nxt.usage.prompt_tokens == last.usage.prompt_tokens + len(got) + delta
    stub.CloseSession(pb.CloseSessionRequest(session_id=sid))


def test_expiry_close_and_capacity(stub):
    short = stub.OpenSession(pb.OpenSessionRequest(ttl_seconds=1)).session_id
    closed = stub.OpenSession(pb.OpenSessionRequest()).session_id
    small = stub.OpenSession(pb.OpenSessionRequest(capacity=40))
    assert small.capacity == 40 and small.ttl_seconds == 600
    gen(stub, 2, chat=chat(("user", "Hi")), session_id=short)
    stub.CloseSession(pb.CloseSessionRequest(session_id=closed))
    with pytest.raises(grpc.RpcError) as e:
        gen(stub, 2, chat=chat(("user", "Hi")), session_id=closed)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND and "closed" in e.value.details()
    time.sleep(2.5)
    with pytest.raises(grpc.RpcError) as e:
        gen(stub, 2, chat=chat(("user", "Hi again")), session_id=short)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND and "expired" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        gen(stub, 100, chat=chat(("user", "Hi")), session_id=small.session_id)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "max_tokens" in e.value.details()
    # without max_tokens a turn may fill what is left of the capacity, no more
    resps = list(stub.Generate(pb.GenerateRequest(chat=chat(("user", "Hi")), session_id=small.session_id,
                                                  sampling_params=pb.SamplingParams(temperature=0.0, ignore_eos=True)),
                               timeout=120))
    assert resps[-1].usage.prompt_tokens + resps[-1].usage.completion_tokens == 40
    with pytest.raises(grpc.RpcError) as e:
        gen(stub, 1, chat=chat(("user", "More")), session_id=small.session_id)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "full" in e.value.details()
    stub.CloseSession(pb.CloseSessionRequest(session_id=small.session_id))
    assert load(stub).num_sessions == 0


def test_pinned_prefix_survives_the_burst_and_respects_its_limits(stub):
    system = ("system", "You are the archivist. " + " ".join(f"Rule {i}: keep record {i * 7} safe." for i in range(30)))
    pin = stub.PinPrefix(pb.PinPrefixRequest(chat=chat(system, add=False)))
    assert pin.tokens > 300 and load(stub).pinned_tokens == pin.tokens
    burst(stub, 2)
    _, _, last = gen(stub, 4, chat=chat(system, ("user", "What is rule 3?")))
    assert last.usage.cached_tokens >= pin.tokens  # the whole pinned prefix, after the burst
    with pytest.raises(grpc.RpcError) as e:  # more than the cap has left
        stub.PinPrefix(pb.PinPrefixRequest(token_ids=pb.TokenIds(ids=[50 + i % 1900 for i in range(PINNED)])))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-pinned-tokens" in e.value.details()
    assert stub.UnpinPrefix(pb.UnpinPrefixRequest(pin_id=pin.pin_id)).tokens == pin.tokens
    with pytest.raises(grpc.RpcError) as e:
        stub.UnpinPrefix(pb.UnpinPrefixRequest(pin_id=pin.pin_id))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    brief = stub.PinPrefix(pb.PinPrefixRequest(text="A short anchor that expires.", ttl_seconds=1))
    assert load(stub).num_pinned_prefixes == 1
    time.sleep(2.5)
    assert load(stub).num_pinned_prefixes == 0 and load(stub).pinned_tokens == 0
    with pytest.raises(grpc.RpcError) as e:
        stub.UnpinPrefix(pb.UnpinPrefixRequest(pin_id=brief.pin_id))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


def _post(server, path: str, body: dict, method: str = "POST") -> tuple[int, dict]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(server.http_url + path, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_http_sessions(server):
    code, s = _post(server, "/v1/sessions", {"ttl_seconds": 120, "capacity": 600})
    assert code == 200 and s["object"] == "session" and s["capacity"] == 600 and s["ttl_seconds"] == 120
    msg = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8, "temperature": 0,
           "session_id": s["id"]}
    code, first = _post(server, "/v1/chat/completions", msg)
    assert code == 200
    code, second = _post(server, "/v1/chat/completions", {**msg, "messages": [{"role": "user", "content": "More"}]})
    assert code == 200
    history = first["usage"]["prompt_tokens"] + first["usage"]["completion_tokens"]
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == history - 1
    code, done = _post(server, f"/v1/sessions/{s['id']}", None, "DELETE")
    assert code == 200 and done == {"id": s["id"], "object": "session.deleted", "deleted": True,
                                    "tokens": second["usage"]["prompt_tokens"] + second["usage"]["completion_tokens"]}
    code, err = _post(server, f"/v1/sessions/{s['id']}", None, "DELETE")
    assert code == 404 and "closed" in err["error"]["message"]
    code, err = _post(server, "/v1/chat/completions", msg)
    assert code == 404 and err["error"]["code"] == "not_found"
    code, small = _post(server, "/v1/sessions", {"capacity": 20})
    code, err = _post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 50, "session_id": small["id"]})
    assert code == 400 and "max_tokens" in err["error"]["message"]


@pytest.mark.parametrize("path, body, field", [
    ("/v1/sessions", {"ttl_seconds": 0}, "ttl_seconds"),
    ("/v1/sessions", {"ttl_seconds": 10**7}, "ttl_seconds"),
    ("/v1/sessions", {"capacity": 0}, "capacity"),
    ("/v1/sessions", {"capacity": PINNED + 1}, "capacity"),
    ("/v1/sessions", {"cache_salt": "x" * 300}, "cache_salt"),
    ("/v1/sessions", {"ttl": 5}, "ttl"),
    ("/v1/completions", {"prompt": "Hi", "session_parent": "x"}, "session_parent"),
    ("/v1/completions", {"prompt": "Hi", "session_id": ""}, "session_id"),
    ("/v1/completions", {"prompt": "Hi", "session_id": "s" * 300}, "session_id"),
    ("/v1/completions", {"prompt": ["a", "b"], "session_id": "sess-x"}, "session_id"),
    ("/v1/completions", {"prompt": "Hi", "session_id": "sess-x", "temperature": -1}, "temperature"),
])
def test_http_bad_session_input_is_400(server, path, body, field):
    code, err = _post(server, path, body)
    assert code == 400 and field in err["error"]["message"], err


def _grpc_cases(stub, sid: str) -> dict:
    hi = dict(chat=chat(("user", "Hi")), sampling_params=pb.SamplingParams(max_tokens=2))
    gen_ = lambda **kw: list(stub.Generate(pb.GenerateRequest(**{**hi, **kw}), timeout=60))  # noqa: E731
    return {
        "session_id too long": (lambda: gen_(session_id="s" * 300), "INVALID_ARGUMENT", "session_id"),
        "unknown session": (lambda: gen_(session_id="sess-nope"), "NOT_FOUND", "does not exist"),
        "bad input, unknown session": (lambda: gen_(session_id="sess-nope", sampling_params=pb.SamplingParams(
            temperature=-1)), "INVALID_ARGUMENT", "temperature"),
        "unknown parent": (lambda: gen_(session_id=sid, session_parent="nope"), "NOT_FOUND", "session_parent"),
        "parent without session": (lambda: gen_(session_parent="x"), "INVALID_ARGUMENT", "session_parent"),
        "n > 1": (lambda: gen_(session_id=sid, sampling_params=pb.SamplingParams(max_tokens=2, n=2)),
                  "INVALID_ARGUMENT", "n must be 1"),
        "other cache_salt": (lambda: gen_(session_id=sid, cache_salt="other"), "INVALID_ARGUMENT", "cache_salt"),
        "ttl 0": (lambda: stub.OpenSession(pb.OpenSessionRequest(ttl_seconds=0)), "INVALID_ARGUMENT", "ttl_seconds"),
        "ttl too long": (lambda: stub.OpenSession(pb.OpenSessionRequest(ttl_seconds=10**7)), "INVALID_ARGUMENT",
                         "ttl_seconds"),
        "capacity 0": (lambda: stub.OpenSession(pb.OpenSessionRequest(capacity=0)), "INVALID_ARGUMENT", "capacity"),
        "capacity over the budget": (lambda: stub.OpenSession(pb.OpenSessionRequest(capacity=PINNED + 1)),
                                     "INVALID_ARGUMENT", "capacity"),
        "close without id": (lambda: stub.CloseSession(pb.CloseSessionRequest()), "INVALID_ARGUMENT", "session_id"),
        "close unknown": (lambda: stub.CloseSession(pb.CloseSessionRequest(session_id="sess-nope")), "NOT_FOUND",
                          "does not exist"),
        "pin without input": (lambda: stub.PinPrefix(pb.PinPrefixRequest()), "INVALID_ARGUMENT", "text, token_ids"),
        "pin empty ids": (lambda: stub.PinPrefix(pb.PinPrefixRequest(token_ids=pb.TokenIds())), "INVALID_ARGUMENT",
                          "no tokens"),
        "pin bad id": (lambda: stub.PinPrefix(pb.PinPrefixRequest(token_ids=pb.TokenIds(ids=[5, 99999]))),
                       "INVALID_ARGUMENT", "vocabulary"),
        "pin ttl too long": (lambda: stub.PinPrefix(pb.PinPrefixRequest(text="x", ttl_seconds=10**7)),
                             "INVALID_ARGUMENT", "ttl_seconds"),
        "unpin without id": (lambda: stub.UnpinPrefix(pb.UnpinPrefixRequest()), "INVALID_ARGUMENT", "pin_id"),
        "unpin unknown": (lambda: stub.UnpinPrefix(pb.UnpinPrefixRequest(pin_id="pin-nope")), "NOT_FOUND",
                          "does not exist"),
    }


def test_grpc_bad_session_and_pin_input(stub):
    sid = stub.OpenSession(pb.OpenSessionRequest(cache_salt="mine")).session_id
    for name, (call, code, text) in _grpc_cases(stub, sid).items():
        with pytest.raises(grpc.RpcError) as e:
            call()
        assert (e.value.code().name, text in e.value.details()) == (code, True), (name, e.value.details())
    stub.CloseSession(pb.CloseSessionRequest(session_id=sid))


def test_frontend_session_state(server):
    with bn.Backend(server.target) as backend:
        with bn.session(backend, ttl_seconds=120) as s:
            s += bn.system("You are terse.")
            s += bn.user("Name a colour.")
            s += bn.assistant(bn.gen("colour", max_tokens=8, temperature=0))
            s += bn.user("And a fruit of that colour?")
            s += bn.assistant(bn.gen("fruit", max_tokens=8, temperature=0))
            first, second = s.results["colour"], s.results["fruit"]
            assert second.cached_tokens == first.prompt_tokens + first.completion_tokens - 1
            forks = s.fork(2)
            for i, f in enumerate(forks):
                f += bn.user(f"Another one, number {i}.")
            forks.each(lambda i, f: f._add(bn.assistant(bn.gen("more", max_tokens=4, temperature=0))))
            history = second.prompt_tokens + second.completion_tokens
            # every fork reuses the whole shared history (but its last token); the one that runs second
            # may reuse more: the forks' new user turns start alike ("Another one, number ")
            cached = [f.results["more"].cached_tokens for f in forks]
            assert min(cached) == history - 1 and all(c >= history - 1 for c in cached), (cached, history)
            with pytest.raises(ValueError, match="whole assistant turn"):
                s += bn.assistant("Sure: ", bn.gen("x", max_tokens=2))
            assert s.messages()[-1][0] == "assistant"
        with pytest.raises(bn.ServerError) as e:
            backend.close_session(s.session_id)
        assert e.value.code == "NOT_FOUND"
