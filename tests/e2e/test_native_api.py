"""SGLang's native HTTP API (``POST /generate`` and friends) against ``banyan serve`` with the demo
model, through ``requests`` as SGLang's own clients post: single and batch prompts, ``text`` and
``input_ids``, ``n``, SSE streams, ``max_new_tokens: 0`` (prefill only, cached), prompt and output
log-probs with top-k against HF transformers (fp32, |Δ| ≤ 1e-4), abort, flush, health, the info
endpoints and bad input (400 naming the field). 32-token prefill chunks: long prompts' log-probs
cross chunks."""

from __future__ import annotations

import json
import threading
import time

import pytest
import requests

from tests.support import Server
from tests.support import hf_log_softmax as hf_logprobs  # (one HF forward: row p predicts ids[p + 1])

TOL = 1e-4
LONG = ("The river ran past the old mill, under the bridge and on towards the sea, carrying leaves "
        "and small branches that the storm had torn from the trees along its banks.")


@pytest.fixture(scope="module")
def server(demo_dir, tmp_path_factory):
    s = Server(None, tmp_path_factory.mktemp("native") / "server.log", "--chunked-prefill-size", "32")
    yield s
    assert s.stop() == 0, s.log_text()[-3000:]


@pytest.fixture(scope="module")
def url(server) -> str:
    return server.http_url




def post(url: str, body: dict, **kw) -> requests.Response:
    return requests.post(f"{url}/generate", json=body, timeout=120, **kw)


def ok(url: str, body: dict):
    r = post(url, body)
    assert r.status_code == 200, r.text
    return r.json()


def sse(r: requests.Response) -> list:
    """The ``data:`` payloads of a stream; the last must be ``[DONE]``."""
    events = [line[len("data: "):] for line in r.iter_lines(decode_unicode=True) if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", events[-3:]
    return [json.loads(e) for e in events[:-1]]


def test_info_endpoints(url, demo_dir):
    info = requests.get(f"{url}/get_model_info", timeout=30).json()
    assert info["model_path"] == "banyan-demo" and info["is_generation"] is True
    assert info["tokenizer_path"] == demo_dir and info["architectures"] == ["LlamaForCausalLM"]
    assert requests.get(f"{url}/model_info", timeout=30).json() == info
    si = requests.get(f"{url}/server_info", timeout=30).json()
    assert si["model_path"] == "banyan-demo" and si["dp_size"] == 1 and si["context_length"] > 0
    assert si["internal_states"][0]["max_total_num_tokens"] == si["max_total_num_tokens"]
    assert requests.get(f"{url}/get_server_info", timeout=30).json()["version"] == si["version"]
    assert requests.get(f"{url}/health_generate", timeout=60).status_code == 200


def test_single_text_and_input_ids_agree(url, hf):
    _, tok = hf
    ids = tok.encode("Hello there, my friend")
    a = ok(url, {"text": "Hello there, my friend", "sampling_params": {"max_new_tokens": 6, "temperature": 0}})
    b = ok(url, {"input_ids": ids, "sampling_params": {"max_new_tokens": 6, "temperature": 0}})
    assert a["output_ids"] == b["output_ids"] and len(a["output_ids"]) == 6
    assert a["text"] == b["text"] == tok.decode(a["output_ids"], skip_special_tokens=True)
    m = a["meta_info"]
    assert m["finish_reason"] == {"type": "length", "length": 6}
    assert m["prompt_tokens"] == len(ids) and m["completion_tokens"] == 6 and m["e2e_latency"] > 0
    assert b["meta_info"]["cached_tokens"] >= len(ids) - 1  # the same prompt: served from the cache


def test_default_max_new_tokens_is_128(url):
    out = ok(url, {"text": "Count:", "sampling_params": {"temperature": 0, "ignore_eos": True}})
    assert out["meta_info"]["completion_tokens"] == 128


def test_output_logprobs_and_top_k_match_hf(url, hf):
    _, tok = hf
    ids = tok.encode(LONG)
    out = ok(url, {"input_ids": ids, "sampling_params": {"max_new_tokens": 5, "temperature": 0},
                   "return_logprob": True, "top_logprobs_num": 3, "return_text_in_logprobs": True})
    m, gen = out["meta_info"], out["output_ids"]
    assert m["input_token_logprobs"] == []  # logprob_start_len -1: output log-probs only
    lp = hf_logprobs(hf, ids + gen)
    for k, ((v, t, text), top) in enumerate(zip(m["output_token_logprobs"], m["output_top_logprobs"])):
        row = lp[len(ids) - 1 + k]
        assert t == gen[k] and text == tok.decode([t]) and v == pytest.approx(row[t].item(), abs=TOL)
        want = row.topk(3)
        assert [e[1] for e in top] == want.indices.tolist()
        assert [e[0] for e in top] == pytest.approx(want.values.tolist(), abs=TOL)


@pytest.mark.parametrize("start", [0, 1, 37])
def test_prompt_logprobs_from_start_match_hf(url, hf, start):
    """SGLang's input log-probs: an entry per position from logprob_start_len on, the first None;
    top-k alternatives too. The prompt spans several 32-token prefill chunks."""
    _, tok = hf
    ids = tok.encode(LONG)
    out = ok(url, {"input_ids": ids, "sampling_params": {"max_new_tokens": 2, "temperature": 0},
                   "return_logprob": True, "logprob_start_len": start, "top_logprobs_num": 2})
    m = out["meta_info"]
    entries, tops = m["input_token_logprobs"], m["input_top_logprobs"]
    assert [e[1] for e in entries] == ids[start:] and all(e[2] is None for e in entries)
    assert entries[0][0] is None and tops[0] is None
    lp = hf_logprobs(hf, ids)
    for p in range(start + 1, len(ids)):
        e, top = entries[p - start], tops[p - start]
        assert e[0] == pytest.approx(lp[p - 1, ids[p]].item(), abs=TOL)
        want = lp[p - 1].topk(2)
        assert [x[1] for x in top] == want.indices.tolist()
        assert [x[0] for x in top] == pytest.approx(want.values.tolist(), abs=TOL)
    assert len(m["output_token_logprobs"]) == 2


def test_prefill_only_is_cached_and_scored(url, hf):
    _, tok = hf
    text = LONG + " Then the rain stopped."
    ids = tok.encode(text)
    first = ok(url, {"text": text, "sampling_params": {"max_new_tokens": 0}})
    assert first["text"] == "" and first["output_ids"] == []
    m = first["meta_info"]
    assert m["finish_reason"] == {"type": "length", "length": 0} and m["completion_tokens"] == 0
    assert m["prompt_tokens"] == len(ids)
    again = ok(url, {"text": text, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
                     "logprob_start_len": len(ids) - 3, "return_text_in_logprobs": True})
    m = again["meta_info"]
    assert m["cached_tokens"] >= len(ids) - 3  # the prompt stayed in the radix cache
    lp = hf_logprobs(hf, ids)
    assert [e[1] for e in m["input_token_logprobs"]] == ids[-3:]
    assert [e[2] for e in m["input_token_logprobs"]] == [tok.decode([t]) for t in ids[-3:]]
    assert m["input_token_logprobs"][0][0] is None
    assert [e[0] for e in m["input_token_logprobs"][1:]] == pytest.approx(
        [lp[p - 1, ids[p]].item() for p in range(len(ids) - 2, len(ids))], abs=TOL)


def test_batch_with_n_and_rids(url):
    body = {"text": ["One two", "Three four", "Five"], "rid": ["b-0", "b-1", "b-2"],
            "sampling_params": {"max_new_tokens": 3, "temperature": 0, "n": 2}}
    outs = ok(url, body)
    assert len(outs) == 6 and [o["meta_info"]["id"] for o in outs] == ["b-0", "b-0", "b-1", "b-1", "b-2", "b-2"]
    singles = [ok(url, {"text": t, "sampling_params": {"max_new_tokens": 3, "temperature": 0}}) for t in body["text"]]
    assert [o["output_ids"] for o in outs] == [s["output_ids"] for s in singles for _ in range(2)]
    n2 = ok(url, {"text": "One two", "sampling_params": {"max_new_tokens": 3, "temperature": 0, "n": 2}})
    assert isinstance(n2, list) and len(n2) == 2  # a single prompt with n > 1: a list too
    ids = ok(url, {"input_ids": [[5, 6, 7], [8, 9]], "sampling_params": {"max_new_tokens": 2, "temperature": 0}})
    assert [o["meta_info"]["prompt_tokens"] for o in ids] == [3, 2]
    scored = ok(url, {"text": ["a b c d", "e f g h"], "sampling_params": {"max_new_tokens": 0},
                      "return_logprob": [True, False], "logprob_start_len": [1, 0]})
    assert scored[0]["meta_info"]["input_token_logprobs"][0][0] is None
    assert "input_token_logprobs" not in scored[1]["meta_info"]


def test_stream_is_cumulative_and_ends_with_done(url):
    body = {"text": "Once upon a time", "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
    whole = ok(url, body)
    with post(url, body | {"stream": True}, stream=True) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse(r)
    texts = [e["text"] for e in events]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))  # cumulative
    assert texts[-1] == whole["text"] and events[-1]["output_ids"] == whole["output_ids"]
    assert [e["meta_info"]["finish_reason"] for e in events[:-1]] == [None] * (len(events) - 1)
    assert events[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 8}
    with post(url, {"text": ["x y", "z"], "stream": True, "sampling_params": {"max_new_tokens": 2}}, stream=True) as r:
        batch = sse(r)
    assert {e["index"] for e in batch} == {0, 1}
    assert sum(e["meta_info"]["finish_reason"] is not None for e in batch) == 2


def test_stop_string_and_stop_token(url, hf):
    _, tok = hf
    free = ok(url, {"text": LONG, "sampling_params": {"max_new_tokens": 12, "temperature": 0}})
    ids = free["output_ids"]
    stop_text = tok.decode(ids[4:6])
    out = ok(url, {"text": LONG, "sampling_params": {"max_new_tokens": 12, "temperature": 0, "stop": [stop_text]}})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_text}
    assert stop_text not in out["text"] and free["text"].startswith(out["text"])
    out = ok(url, {"text": LONG, "sampling_params": {"max_new_tokens": 12, "temperature": 0,
                                                     "stop_token_ids": [ids[3]]}})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": ids[3]}
    assert out["output_ids"] == ids[:ids.index(ids[3]) + 1]


def test_logit_bias_min_new_tokens_repetition_penalty(url, hf):
    import torch
    from transformers import RepetitionPenaltyLogitsProcessor

    model, tok = hf
    ids = tok.encode("Once upon a time")
    out = ok(url, {"input_ids": ids, "sampling_params": {"max_new_tokens": 4, "temperature": 0,
                                                         "logit_bias": {"77": 100.0}}})
    assert out["output_ids"] == [77] * 4
    first = ok(url, {"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0}})["output_ids"][0]
    stop = {"max_new_tokens": 6, "temperature": 0, "stop_token_ids": [first]}
    assert ok(url, {"input_ids": ids, "sampling_params": stop})["meta_info"]["completion_tokens"] == 1
    held = ok(url, {"input_ids": ids, "sampling_params": stop | {"min_new_tokens": 3}})
    assert held["meta_info"]["completion_tokens"] >= 3 and first not in held["output_ids"][:3]
    got = ok(url, {"input_ids": ids, "sampling_params": {"max_new_tokens": 8, "temperature": 0,
                                                         "repetition_penalty": 1.5}})["output_ids"]
    penalty, seq = RepetitionPenaltyLogitsProcessor(1.5), torch.tensor([ids])
    with torch.no_grad():
        for _ in range(8):
            scores = penalty(seq, model(seq).logits[:, -1].float())
            seq = torch.cat([seq, scores.argmax(-1, keepdim=True)], dim=1)
    assert got == seq[0, len(ids):].tolist()


def test_regex_constrained(url):
    out = ok(url, {"text": "The year:", "sampling_params": {"max_new_tokens": 8, "regex": "[0-9]{4}"}})
    assert len(out["text"]) == 4 and out["text"].isdigit()


def test_abort_request(url):
    got = {}

    def run():
        got["r"] = ok(url, {"text": "Go on", "rid": "abort-me", "sampling_params": {
            "max_new_tokens": 3000, "ignore_eos": True}})

    t = threading.Thread(target=run)
    t.start()
    deadline = time.monotonic() + 60
    while "r" not in got and time.monotonic() < deadline:  # until the request exists
        time.sleep(0.2)
        requests.post(f"{url}/abort_request", json={"rid": "abort-me"}, timeout=30).raise_for_status()
    t.join(60)
    assert got["r"]["meta_info"]["finish_reason"]["type"] == "abort"
    assert got["r"]["meta_info"]["completion_tokens"] < 3000


def test_flush_cache(url, hf):
    _, tok = hf
    text = "A prompt to flush out of the cache, long enough to matter."
    ok(url, {"text": text, "sampling_params": {"max_new_tokens": 0}})
    assert ok(url, {"text": text, "sampling_params": {"max_new_tokens": 0}})["meta_info"]["cached_tokens"] > 0
    r = requests.post(f"{url}/flush_cache", timeout=30)
    assert r.status_code == 200, r.text
    assert ok(url, {"text": text, "sampling_params": {"max_new_tokens": 0}})["meta_info"]["cached_tokens"] == 0


@pytest.mark.parametrize("body, status, words", [
    ({"sampling_params": {}}, 400, ["text", "input_ids"]),
    ({"text": "a", "input_ids": [1]}, 400, ["text", "input_ids"]),
    ({"text": "a", "image_data": "x.png"}, 400, ["image_data", "multimodal"]),
    ({"text": "a", "lora_path": "adapter"}, 400, ["lora_path"]),
    ({"text": "a", "frobnicate": 1}, 400, ["frobnicate", "unrecognized"]),
    ({"text": "a", "sampling_params": {"stop_regex": "x+"}}, 400, ["sampling_params.stop_regex"]),
    ({"text": "a", "sampling_params": {"logit_bias": {"x": 1.0}}}, 400, ["sampling_params.logit_bias", "'x'"]),
    ({"text": "a", "sampling_params": {"max_new_tokens": 4, "min_new_tokens": 9}}, 400,
     ["sampling_params.min_new_tokens"]),
    ({"text": "a", "sampling_params": {"repetition_penalty": 0}}, 400, ["sampling_params.repetition_penalty"]),
    ({"text": "a", "sampling_params": {"max_new_tokens": -1}}, 400, ["sampling_params.max_new_tokens"]),
    ({"text": "a", "sampling_params": {"max_new_tokens": 0, "n": 2}}, 400, ["sampling_params.n"]),
    ({"text": "a", "sampling_params": {"temperature": -1}}, 400, ["sampling_params.temperature"]),
    ({"text": "a", "sampling_params": {"regex": "a", "ebnf": "root ::= \"a\""}}, 400, ["regex", "ebnf"]),
    ({"text": "a b", "return_logprob": True, "logprob_start_len": 99}, 400, ["logprob_start_len"]),
    ({"text": "a", "return_logprob": True, "top_logprobs_num": 21}, 400, ["top_logprobs_num"]),
    ({"text": ["a", "b"], "rid": "one"}, 400, ["rid"]),
    ({"text": ["a", "b"], "return_logprob": [True]}, 400, ["return_logprob"]),
    ({"input_ids": [1, 10**7]}, 400, ["vocabulary"]),
    ({"text": "a", "sampling_params": {"top_k": "many"}}, 400, ["sampling_params.top_k"]),
])
def test_bad_input_is_400_naming_the_field(url, body, status, words):
    r = post(url, body)
    assert r.status_code == status, r.text
    msg = r.json()["error"]["message"]
    assert all(w in msg for w in words), msg


def test_session_turns_priority_and_metrics(server, url):
    sid = requests.post(f"{url}/open_session", json={}, timeout=30).json()
    first = ok(url, {"text": LONG, "session_params": {"id": sid}, "priority": 5,
                     "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
    second = ok(url, {"text": " And then?", "session_params": {"id": sid}, "sampling_params": {"max_new_tokens": 4}})
    m1, m2 = first["meta_info"], second["meta_info"]
    assert m2["prompt_tokens"] > m1["prompt_tokens"] + m1["completion_tokens"]  # the session's tokens + the turn
    assert m2["cached_tokens"] >= m1["prompt_tokens"]  # the session kept them
    r = post(url, {"text": "x", "session_params": {"id": sid, "offset": 3}})
    assert r.status_code == 400 and "session_params.offset" in r.json()["error"]["message"]
    assert requests.post(f"{url}/close_session", json={"session_id": sid}, timeout=30).status_code == 200
    r = post(url, {"text": "x", "session_params": {"id": sid}})
    assert r.status_code == 404, r.text
    r = post(url, {"text": "x"}, headers={"x-banyan-priority": "high"})
    assert r.status_code == 400 and "x-banyan-priority" in r.json()["error"]["message"]
    text = server.metrics()
    assert 'endpoint="/generate",status="200"' in text and 'endpoint="/open_session"' in text


def test_unserved_endpoints_and_rid_in_flight(url):
    r = requests.post(f"{url}/encode", json={"text": "a"}, timeout=30)
    assert r.status_code == 501 and "/encode" in r.json()["error"]["message"]
    r = requests.post(f"{url}/concate_and_append_request", json={"src_rids": ["a"], "dst_rid": "b"}, timeout=30)
    assert r.status_code == 501 and "concate_and_append" in r.json()["error"]["message"]
    r = requests.post(f"{url}/abort_request", json={}, timeout=30)
    assert r.status_code == 400 and "rid" in r.json()["error"]["message"]
    assert requests.get(f"{url}/health_generate", timeout=60).status_code == 200
