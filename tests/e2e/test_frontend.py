"""The frontend language (``banyan.lang``) end to end against ``banyan serve`` with the demo model:
the example programs (multi-turn chat, intent branch, document + questions via run_batch, a
five-step reasoning chain), ``select`` and the Score RPC against an independent HF transformers
computation, prefix sharing (Score, fork), and server errors as Python exceptions.

The server runs with 32-token prefill chunks, so long prompts are scored across several chunks."""

from __future__ import annotations

import json
import math
import re
import sys

import jsonschema
import pytest

import banyan as bn
from tests.support import ROOT, Server, free_port
from services.scheduler.batcher import DEDUP_MIN_TOKENS
from shared.proto.banyan.v1 import generation_pb2 as pb

sys.path.insert(0, str(ROOT / "examples"))
import document_qa  # noqa: E402
import intent_branch  # noqa: E402
import multi_turn_chat  # noqa: E402
import reasoning_chain  # noqa: E402

TOL = 1e-4
CHUNK = 32


@pytest.fixture(scope="module")
def server(demo_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("frontend")
    s = Server(None, d / "server.log", "--chunked-prefill-size", str(CHUNK), "--http-port", "-1")
    yield s
    assert s.stop() == 0, s.log_text()[-3000:]


@pytest.fixture(scope="module")
def backend(server):
    with bn.Backend(server.target) as b:
        yield b



def hf_logprobs(hf, ids: list[int], start: int) -> list[float]:
    """log p(ids[i] | ids[:i]) for i in start..len(ids)-1, from one HF forward pass."""
    import torch

    model, _ = hf
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    return [lp[i - 1, ids[i]].item() for i in range(start, len(ids))]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def reference(hf, base: list[int], full: list[int]) -> tuple[list[int], list[float]]:
    """Continuation ids and their logprobs by services/tokenizer/scoring.py's rule: the continuation
    starts where ``full`` (prompt + continuation, tokenized) leaves the prompt's ids."""
    start = max(1, min(common_prefix(base, full), len(full) - 1))
    return full[start:], hf_logprobs(hf, full, start)


def assert_scores_match(resp: pb.ScoreResponse, refs: list[tuple[list[int], list[float]]]) -> None:
    assert len(resp.scores) == len(refs)
    for got, (ids, lps) in zip(resp.scores, refs):
        assert [t.token_id for t in got.tokens] == ids
        assert [t.logprob for t in got.tokens] == pytest.approx(lps, abs=TOL)
        assert got.logprob_sum == pytest.approx(sum(lps), abs=TOL)
        assert got.logprob_mean == pytest.approx(sum(lps) / len(lps), abs=TOL)


def check_select(hf, s: bn.ProgramState, name: str, prompt_ids: list[int], choices: list[str], method: str) -> None:
    """``s[name]`` (a select over ``choices`` after ``prompt_ids``) against HF: the same continuation
    ids, scores within TOL for both methods, and the same choice for ``method``."""
    _, tok = hf
    refs = [reference(hf, prompt_ids, prompt_ids + tok.encode(c, add_special_tokens=False)) for c in choices]
    assert_scores_match(s.scores[name], refs)
    want = [sum(lps) / len(lps) if method == "mean" else sum(lps) for _, lps in refs]
    assert s[f"{name}_scores"] == pytest.approx(want, abs=TOL)
    best = max(range(len(want)), key=want.__getitem__)
    runner_up = max((v for i, v in enumerate(want) if i != best), default=-math.inf)
    if want[best] - runner_up > 2 * TOL:  # not a near-tie: the choice is determined
        assert s[name] == choices[best], (want, s[name])


def load(stub) -> pb.GetLoadResponse:
    return stub.GetLoad(pb.GetLoadRequest())


# ---- the example programs ------------------------------------------------------------------

def test_multi_turn_chat(backend, stub):
    s = multi_turn_chat.multi_turn_chat.run(multi_turn_chat.QUESTIONS, max_tokens=12, backend=backend)
    msgs = s.messages()
    assert [r for r, _ in msgs] == ["system"] + ["user", "assistant"] * 3
    assert [c for r, c in msgs if r == "user"] == multi_turn_chat.QUESTIONS
    answers = [s[f"answer_{i}"] for i in range(3)]
    assert [c for r, c in msgs if r == "assistant"] == answers and all(answers)
    usage = [s.results[f"answer_{i}"] for i in range(3)]
    assert all(0 < u.completion_tokens <= 12 for u in usage)
    # each turn's prompt is the whole conversation so far, rendered with the chat template
    for i, u in enumerate(usage):
        convo = [pb.ChatMessage(role=r, content=c) for r, c in msgs[: 2 + 2 * i]]
        ids = stub.Tokenize(pb.TokenizeRequest(chat=pb.ChatInput(messages=convo))).token_ids
        assert u.prompt_tokens == len(ids)
    # and the earlier turns come from the prefix cache
    for prev, cur in zip(usage, usage[1:]):
        assert cur.cached_tokens >= prev.prompt_tokens - 1, usage


def test_intent_branch_follows_the_selected_intent(backend):
    follow = {"weather": {"city", "forecast"}, "arithmetic": {"result"}, "small talk": {"reply"}}
    every = set().union(*follow.values())
    for request in intent_branch.REQUESTS:
        s = intent_branch.route.run(request, max_tokens=8, backend=backend)
        intent = s["intent"]
        assert intent in intent_branch.INTENTS
        assert every & set(s.values) == follow[intent]
        roles = [r for r, _ in s.messages()]
        assert roles == ["system", "user", "assistant"] + ["user", "assistant"] * len(follow[intent])
        assert s.messages()[2] == ("assistant", intent)
        if intent == "arithmetic":
            assert re.fullmatch(r"-?[0-9]{1,8}", s["result"])
        for name in follow[intent] - {"result"}:
            assert "\n" not in s[name]


@pytest.mark.parametrize("method", ["mean", "sum"])
def test_select_matches_hf(backend, stub, hf, method):
    request = intent_branch.REQUESTS[1]
    s = intent_branch.route.run(request, method=method, max_tokens=4, backend=backend)
    system, user = s.messages()[:2]
    # the ids the frontend sends: the conversation + assistant header, tokenized by the server
    chat = pb.ChatInput(messages=[pb.ChatMessage(role=r, content=c) for r, c in (system, user)],
                        add_generation_prompt=True)
    prompt_ids = list(stub.Tokenize(pb.TokenizeRequest(chat=chat)).token_ids)
    assert s.scores["intent"].prompt_tokens == len(prompt_ids)
    check_select(hf, s, "intent", prompt_ids, intent_branch.INTENTS, method)


def test_document_qa_run_batch(backend, stub, capfd):
    qs = document_qa.QUESTIONS
    states = document_qa.document_qa.run_batch([{"document": document_qa.DOCUMENT, "question": q, "max_tokens": 12}
                                                for q in qs],
                                               backend=backend, num_threads=3, progress_bar=True)
    assert "3/3" in capfd.readouterr().err  # the progress bar
    assert len(states) == 3
    for q, s in zip(qs, states):  # in the batch's order
        assert s.messages()[1][1].endswith(f"Question: {q}")
        assert isinstance(s["answer"], str) and "\n\n" not in s["answer"]
    # the system prompt + document are computed once: the other programs take them from the cache
    convos = [[pb.ChatMessage(role=r, content=c) for r, c in s.messages()[:2]] for s in states]
    toks = [list(stub.Tokenize(pb.TokenizeRequest(chat=pb.ChatInput(messages=c))).token_ids) for c in convos]
    shared = min(common_prefix(toks[0], t) for t in toks[1:])
    assert shared > 150
    cached = sorted(s.results["answer"].cached_tokens for s in states)
    # (a request waits for a prefix another is computing unless less than DEDUP_MIN_TOKENS of it is left)
    assert cached[1] >= shared - DEDUP_MIN_TOKENS, cached


def test_reasoning_chain(backend, stub, hf):
    s = reasoning_chain.reasoning_chain.run(reasoning_chain.PROBLEM, max_tokens=12, backend=backend)
    text = s.text()
    steps = [text.index(f"Step {i}.") for i in range(1, 6)]
    assert steps == sorted(steps) and text.startswith(f"Problem: {reasoning_chain.PROBLEM}\n")
    assert "\n" not in s["question"] and "\n" not in s["plan"] and "Step" not in s["plan"]  # stop strings
    jsonschema.validate(json.loads(s["numbers"]), reasoning_chain.NUMBERS_SCHEMA)
    assert s.results["numbers"].finish_reason == "stop"  # the grammar ended the JSON
    assert re.fullmatch(r"[0-9]{1,5}", s["answer"])
    assert s["check"] in ("yes", "no")
    assert text.endswith(f"Step 5. Is that answer right? {s['check']}\n")
    # the plain-text select: prompt = the text so far, tokenized with BOS
    prefix = text[: -len(s["check"] + "\n")]
    prompt_ids = list(stub.Tokenize(pb.TokenizeRequest(text=prefix)).token_ids)
    assert len(prompt_ids) > 2 * CHUNK  # scored across prefill chunks
    check_select(hf, s, "check", prompt_ids, ["yes", "no"], "mean")


# ---- the Score RPC ---------------------------------------------------------------------------

CONTINUATIONS = [" yes", " no", " the baker sold all of the bread", "!"]


def test_score_rpc_matches_hf_for_text_token_ids_and_chat(stub, hf):
    _, tok = hf
    text = ("The baker opened the shop at dawn and put forty loaves of bread on the shelves by the window. "
            "Question: did the baker sell every loaf of bread at the market this morning? Answer:")
    base = tok.encode(text)
    assert len(base) > CHUNK
    r = stub.Score(pb.ScoreRequest(text=text, continuations=CONTINUATIONS))
    assert r.prompt_tokens == len(base)
    assert_scores_match(r, [reference(hf, base, tok.encode(text + c)) for c in CONTINUATIONS])

    ids = list(stub.Tokenize(pb.TokenizeRequest(text="The weather in the town was")).token_ids)
    r = stub.Score(pb.ScoreRequest(token_ids=pb.TokenIds(ids=ids), continuations=CONTINUATIONS))
    assert_scores_match(r, [reference(hf, ids, ids + tok.encode(c, add_special_tokens=False)) for c in CONTINUATIONS])

    msgs = [{"role": "system", "content": "Answer yes or no."}, {"role": "user", "content": "Is bread baked?"}]
    rendered = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    base = tok.encode(rendered, add_special_tokens=False)
    chat = pb.ChatInput(messages=[pb.ChatMessage(role=m["role"], content=m["content"]) for m in msgs])
    r = stub.Score(pb.ScoreRequest(chat=chat, continuations=["Yes", "No", "Maybe, I do not know"]))
    assert r.prompt_tokens == len(base)
    assert_scores_match(r, [reference(hf, base, tok.encode(rendered + c, add_special_tokens=False))
                            for c in ["Yes", "No", "Maybe, I do not know"]])


def test_score_computes_the_prefix_once(stub):
    text = ("A lighthouse keeper counted the ships that passed his island every night for a year, and wrote "
            "the numbers in a small blue notebook. At the end of the year he asked: which month was busiest?")
    conts = [" January", " July", " the month of December", " none"]
    before = load(stub)
    r = stub.Score(pb.ScoreRequest(text=text, continuations=conts))
    after = load(stub)
    p, k = r.prompt_tokens, len(conts)
    assert p > CHUNK
    cont_tokens = sum(len(s.tokens) for s in r.scores)
    computed = after.prefill_computed_tokens - before.prefill_computed_tokens
    # the prompt once, each continuation, and at most one prompt token again per continuation
    # (its logits predict the continuation's first token)
    assert p + cont_tokens - 8 <= computed <= p + cont_tokens + k, (computed, p, cont_tokens)
    assert sorted(s.cached_tokens for s in r.scores)[1] >= p - 1  # all but one reuse the prompt

    before = load(stub)
    again = stub.Score(pb.ScoreRequest(text=text, continuations=conts))
    after = load(stub)
    assert all(s.cached_tokens >= p - 1 for s in again.scores)
    assert after.prefill_computed_tokens - before.prefill_computed_tokens <= cont_tokens + k
    assert [s.logprob_sum for s in again.scores] == pytest.approx([s.logprob_sum for s in r.scores], abs=TOL)


# ---- fork --------------------------------------------------------------------------------------

def test_fork_shares_the_prefix(backend, stub):
    @bn.function
    def story(s):
        s += ("Once upon a time, in a village by the sea, four sisters each told a different story "
              "about the old lighthouse on the hill. The first sister began:")
        forks = s.fork(4)
        forks += bn.gen("story", max_tokens=6, temperature=0.8)  # on the four branches at once
        for i, f in enumerate(forks):
            f += f" (sister {i + 1})"
        s.values["forks"] = forks.join()

    before = load(stub)
    s = story.run(backend=backend)
    after = load(stub)
    forks = s["forks"]
    assert len(forks) == 4 and all(f.text().endswith(f" (sister {i + 1})") for i, f in enumerate(forks))
    assert "story" not in s.values  # the parent is untouched
    usage = [f.results["story"] for f in forks]
    p = usage[0].prompt_tokens
    assert all(u.prompt_tokens == p for u in usage) and p > CHUNK
    cached = sorted(u.cached_tokens for u in usage)
    assert cached[1] >= p - 1, cached  # at least three forks took the shared prefix from the cache
    assert after.prefill_computed_tokens - before.prefill_computed_tokens <= p + 3


# ---- errors -------------------------------------------------------------------------------------

def test_server_errors_surface_as_exceptions(backend):
    assert bn.ServerError is bn.lang.ServerError

    @bn.function
    def bad_regex(s):
        s += "Digits:"
        s += bn.gen("x", regex="([0-9]+", max_tokens=4)

    with pytest.raises(bn.ServerError) as e:
        bad_regex.run(backend=backend)
    assert e.value.code == "INVALID_ARGUMENT" and "regex" in e.value.message
    assert "parenthesis" in e.value.message.lower()  # the grammar compiler's own words

    @bn.function
    def too_long(s):
        s += "Hello"
        s += bn.gen("x", max_tokens=100000)

    with pytest.raises(bn.ServerError, match=r"INVALID_ARGUMENT: .*max_tokens=100000") as e:
        too_long.run(backend=backend)
    assert "context window" in e.value.message

    @bn.function
    def empty_choice(s):
        s += "Pick:"
        s += bn.select("x", choices=["a", ""])

    with pytest.raises(bn.ServerError, match="continuations must not be empty") as e:
        empty_choice.run(backend=backend)
    assert e.value.code == "INVALID_ARGUMENT"

    # client-side mistakes are caught before anything is sent
    with pytest.raises(ValueError, match="at least one choice"):
        bn.select("x", choices=[])
    with pytest.raises(ValueError, match="'mean'"):
        bn.select("x", choices=["a"], method="max")

    @bn.function
    def gen_in_user_turn(s):
        s += bn.user("Hi", bn.gen("x"))

    with pytest.raises(ValueError, match="assistant turn"):
        gen_in_user_turn.run(backend=backend)

    s = bn.ProgramState(backend)
    with pytest.raises(ValueError, match="do not nest"):
        s += bn.user("Hi", bn.assistant("Hello"))
    s += bn.user("Hi")  # the failed turn left nothing behind
    assert s.messages() == [("user", "Hi")]
    with pytest.raises(ValueError, match="assistant turn"):
        s += bn.gen("x")  # outside any turn

    with bn.Backend(f"127.0.0.1:{free_port()}", timeout=5) as nowhere:
        with pytest.raises(bn.ServerError) as e:
            bad_regex.run(backend=nowhere)
        assert e.value.code == "UNAVAILABLE"

    # the server is fine afterwards
    @bn.function
    def fine(s):
        s += "Hello"
        s += bn.gen("x", max_tokens=3, temperature=0, ignore_eos=True)

    assert fine.run(backend=backend).results["x"].completion_tokens == 3


def test_default_backend_and_address_from_env(server, monkeypatch):
    monkeypatch.setenv("BANYAN_ADDRESS", server.target)
    with bn.Backend() as b:
        assert b.address == server.target
        bn.set_default_backend(b)
        try:
            s = multi_turn_chat.multi_turn_chat(["Hello?"], max_tokens=2)  # calling a program runs it
            assert s.results["answer_0"].prompt_tokens > 0
        finally:
            bn.set_default_backend(None)
