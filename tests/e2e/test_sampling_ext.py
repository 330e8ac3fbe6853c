"""The engine's sampling and scoring extensions through ``banyan serve`` (gRPC ``banyan.v1``, the
demo model) against HF transformers in fp32: prompt log-probs from any start position with
alternatives, on the first message. The server runs 32-token prefill chunks, so long prompts are
scored across several chunks."""

from __future__ import annotations

import pytest

from shared.proto.banyan.v1 import generation_pb2 as pb
from tests.support import Server, hf_log_softmax

TOL = 1e-4
CHUNK = 32
TEXT = ("The river bends twice before it reaches the old mill, where the water slows and the town begins. "
        "On market days the square fills with carts of apples, cheese and bread, and the bells ring at noon.")


@pytest.fixture(scope="module")
def server(demo_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("sampling_ext")
    s = Server(None, d / "server.log", "--chunked-prefill-size", str(CHUNK), "--http-port", "-1")
    yield s
    assert s.stop() == 0, s.log_text()[-3000:]




def prompt_ids(hf, n: int) -> list[int]:
    ids = hf[1].encode(TEXT * 4)
    assert len(ids) >= n
    return ids[:n]


def generate(stub, ids: list[int], **sampling) -> list[pb.GenerateResponse]:
    sampling.setdefault("temperature", 0.0)
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), sampling_params=pb.SamplingParams(**sampling))
    return list(stub.Generate(req, timeout=120))


def check_prompt_logprobs(hf, ids: list[int], start: int, top: int, entries) -> None:
    lp = hf_log_softmax(hf, ids)
    assert [e.token_id for e in entries] == ids[start:]
    for pos, e in zip(range(start, len(ids)), entries):
        if pos == 0:
            assert not e.HasField("logprob") and not e.top
            continue
        assert e.logprob == pytest.approx(lp[pos - 1, ids[pos]].item(), abs=TOL), pos
        want_lp, want_ids = lp[pos - 1].topk(top) if top else (lp[:0, 0], lp[:0, 0])
        assert len(e.top) == top
        assert [t.logprob for t in e.top] == pytest.approx(want_lp.tolist(), abs=TOL)
        # (ids of near-ties may swap: compare each listed id's own logprob instead)
        assert [lp[pos - 1, t.token_id].item() for t in e.top] == pytest.approx(want_lp.tolist(), abs=TOL)


@pytest.mark.parametrize("start,top,n", [(0, 2, 1), (0, 0, 5), (0, 3, 70), (1, 0, 40), (37, 5, 90), (89, 2, 90)])
def test_prompt_logprobs_match_hf(stub, hf, start, top, n):
    """From the first token (no logprob), from inside a chunk, from the last token; with and without
    alternatives; prompts of one and of several prefill chunks. They come on the first message."""
    ids = prompt_ids(hf, n)
    sampling = dict(max_tokens=3, prompt_logprobs_start=start)
    if top:
        sampling["prompt_top_logprobs"] = top
    resps = generate(stub, ids, **sampling)
    assert resps[0].token_ids, "the first message carries the first token"
    check_prompt_logprobs(hf, ids, start, top, resps[0].prompt_logprobs)
    assert not any(r.prompt_logprobs for r in resps[1:])
    # the output is what a request without prompt logprobs gets
    plain = generate(stub, ids, max_tokens=3)
    assert [t for r in resps for t in r.token_ids] == [t for r in plain for t in r.token_ids]


def test_prompt_logprobs_use_the_cache_before_the_start(stub, hf):
    """A prompt cached by an earlier request: positions before the start come from the cache."""
    ids = prompt_ids(hf, 100)
    generate(stub, ids, max_tokens=1)
    resps = generate(stub, ids, max_tokens=1, prompt_logprobs_start=80)
    check_prompt_logprobs(hf, ids, 80, 0, resps[0].prompt_logprobs)
    assert resps[-1].usage.cached_tokens == 79  # (the logits of position 79 are needed: it is computed)


def test_prompt_logprobs_come_once_with_n(stub, hf):
    ids = prompt_ids(hf, 20)
    resps = generate(stub, ids, max_tokens=2, n=3, temperature=1.0, seed=7, prompt_logprobs_start=2)
    with_lp = [r for r in resps if r.prompt_logprobs]
    assert len(with_lp) == 1 and with_lp[0].index == 0
    check_prompt_logprobs(hf, ids, 2, 0, with_lp[0].prompt_logprobs)


@pytest.mark.parametrize("sampling,field", [
    (dict(prompt_logprobs_start=20), "prompt_logprobs_start"),
    (dict(prompt_top_logprobs=2), "prompt_top_logprobs"),
    (dict(prompt_logprobs_start=0, prompt_top_logprobs=21), "prompt_top_logprobs"),
])
def test_bad_prompt_logprob_fields_are_invalid_argument(stub, hf, sampling, field):
    import grpc

    with pytest.raises(grpc.RpcError) as e:
        generate(stub, prompt_ids(hf, 20), max_tokens=1, **sampling)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"sampling_params.{field}" in e.value.details()


# ---- max_tokens 0: prefill only ------------------------------------------------------------------
def test_prefill_only_returns_prompt_logprobs_and_caches_the_prompt(stub, hf):
    ids = prompt_ids(hf, 75)
    resps = generate(stub, ids, max_tokens=0, prompt_logprobs_start=0, prompt_top_logprobs=2)
    assert len(resps) == 1
    last = resps[0]
    assert last.finish_reason == pb.FINISH_REASON_LENGTH and not last.token_ids and not last.text
    assert last.usage.prompt_tokens == 75 and last.usage.completion_tokens == 0
    check_prompt_logprobs(hf, ids, 0, 2, last.prompt_logprobs)
    # the prompt is in the radix cache: a request continuing it reuses it (all but the token it recomputes)
    again = generate(stub, ids + [ids[3]], max_tokens=1)
    assert again[-1].usage.cached_tokens == 75


def test_prefill_only_without_logprobs_and_with_priority(stub, hf):
    ids = prompt_ids(hf, 30)
    resps = generate(stub, ids, max_tokens=0)
    assert [(r.finish_reason, list(r.token_ids), len(r.prompt_logprobs)) for r in resps] == \
        [(pb.FINISH_REASON_LENGTH, [], 0)]
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids[:29]), priority=10,
                             sampling_params=pb.SamplingParams(max_tokens=0))
    resps = list(stub.Generate(req, timeout=60))
    assert resps[-1].finish_reason == pb.FINISH_REASON_LENGTH and resps[-1].usage.cached_tokens == 28


def test_prefill_only_session_turn_joins_the_session(stub, hf):
    ids = prompt_ids(hf, 40)
    sid = stub.OpenSession(pb.OpenSessionRequest(ttl_seconds=60)).session_id
    first = list(stub.Generate(pb.GenerateRequest(
        request_id="pf-turn-1", token_ids=pb.TokenIds(ids=ids[:30]), session_id=sid,
        sampling_params=pb.SamplingParams(max_tokens=0, prompt_logprobs_start=0)), timeout=60))
    assert first[-1].finish_reason == pb.FINISH_REASON_LENGTH and first[-1].usage.completion_tokens == 0
    check_prompt_logprobs(hf, ids[:30], 0, 0, first[0].prompt_logprobs)
    # the next turn continues it: its positions count from its own input (the session's first turn before)
    second = list(stub.Generate(pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=ids[30:]), session_id=sid,
        sampling_params=pb.SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs_start=0)), timeout=60))
    assert second[-1].usage.prompt_tokens == 40 and second[-1].usage.cached_tokens >= 29
    lp = hf_log_softmax(hf, ids)
    got = second[0].prompt_logprobs
    assert [e.token_id for e in got] == ids[30:]
    assert [e.logprob for e in got] == pytest.approx([lp[p - 1, ids[p]].item() for p in range(30, 40)], abs=TOL)
    stub.CloseSession(pb.CloseSessionRequest(session_id=sid))




def test_prefill_only_with_n_is_invalid_argument(stub, hf):
    import grpc

    with pytest.raises(grpc.RpcError) as e:
        generate(stub, prompt_ids(hf, 10), max_tokens=0, n=2)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling_params.n must be 1 with max_tokens 0" in e.value.details()


# ---- logit processors: logit_bias, min_tokens, repetition_penalty --------------------------------
def f32(x: float) -> float:
    """The value as the proto's float carries it."""
    import numpy as np

    return float(np.float32(x))


def hf_greedy(hf, ids: list[int], n: int, **kw) -> list[int]:
    import torch

    with torch.no_grad():
        out = hf[0].generate(torch.tensor([ids]), do_sample=False, max_new_tokens=n, pad_token_id=0,
                             attention_mask=torch.ones(1, len(ids), dtype=torch.long), **kw)
    return out[0, len(ids):].tolist()


def tokens(resps) -> list[int]:
    return [t for r in resps for t in r.token_ids]


@pytest.mark.parametrize("text,penalty", [("Hello world. " * 6, 1.3), (TEXT, 0.8)])
def test_repetition_penalty_matches_hf_generate(stub, hf, text, penalty):
    ids = hf[1].encode(text)[:40]
    got = tokens(generate(stub, ids, max_tokens=16, repetition_penalty=penalty))
    assert got == hf_greedy(hf, ids, 16, repetition_penalty=f32(penalty))
    assert got != tokens(generate(stub, ids, max_tokens=16))  # (it changed something)


def test_logit_bias_matches_hf_sequence_bias(stub, hf):
    ids = prompt_ids(hf, 12)
    plain = tokens(generate(stub, ids, max_tokens=8))
    bias = {plain[0]: -100.0, 1234: 7.5, 99: 250.0}  # (250 is clamped to 100)
    got = tokens(generate(stub, ids, max_tokens=8, logit_bias=bias, ignore_eos=True))
    want = hf_greedy(hf, ids, 8, sequence_bias={(t,): min(b, 100.0) for t, b in bias.items()})
    assert got == want and plain[0] not in got


def test_min_tokens_holds_back_eos(stub, hf):
    eos = list(stub.GetModelInfo(pb.GetModelInfoRequest()).eos_token_ids)
    ids = prompt_ids(hf, 10)
    push = {eos[0]: 100.0}  # EOS would come first
    assert tokens(generate(stub, ids, max_tokens=8, logit_bias=push)) == [eos[0]]
    resps = generate(stub, ids, max_tokens=8, logit_bias=push, min_tokens=4)
    got = tokens(resps)
    assert got == hf_greedy(hf, ids, 8, sequence_bias={(eos[0],): 100.0}, min_new_tokens=4, eos_token_id=eos)
    assert len(got) == 5 and got[-1] == eos[0] and not set(got[:4]) & set(eos)
    assert resps[-1].finish_reason == pb.FINISH_REASON_STOP
    # ignore_eos: the EOS is generated but does not stop it
    got = tokens(generate(stub, ids, max_tokens=6, logit_bias=push, ignore_eos=True))
    assert got == [eos[0]] * 6


def test_processors_with_sampling_and_n_follow_their_own_rows(stub, hf):
    """Rows with and without processors in one batch: each seeded sample is what it is alone."""
    ids = prompt_ids(hf, 15)
    kw = dict(max_tokens=6, temperature=0.9, seed=11, repetition_penalty=1.5, logit_bias={5: 3.0})
    together = generate(stub, ids, n=3, **kw)
    per_index = {i: [t for r in together if r.index == i for t in r.token_ids] for i in range(3)}
    alone = tokens(generate(stub, ids, **kw))
    assert per_index[0] == alone


@pytest.mark.parametrize("sampling,words", [
    (dict(logit_bias={10**7: 1.0}), "sampling_params.logit_bias: token id 10000000 is out of the vocabulary"),
    (dict(logit_bias={5: float("nan")}), "sampling_params.logit_bias[5] must be a finite number"),
    (dict(min_tokens=9, max_tokens=4), "sampling_params.min_tokens must be in [0, max_tokens=4]"),
    (dict(repetition_penalty=0.0), "sampling_params.repetition_penalty must be in (0, 2]"),
    (dict(repetition_penalty=3.0), "sampling_params.repetition_penalty must be in (0, 2]"),
])
def test_bad_processor_fields_are_invalid_argument(stub, hf, sampling, words):
    import grpc

    sampling.setdefault("max_tokens", 2)
    with pytest.raises(grpc.RpcError) as e:
        generate(stub, prompt_ids(hf, 5), **sampling)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert words in e.value.details()
