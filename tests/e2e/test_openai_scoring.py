"""Scoring on the OpenAI surface (``banyan serve``, the demo model) against HF transformers in fp32:
``/v1/completions`` ``echo`` with ``logprobs`` (also ``max_tokens: 0``, token-id prompts, streamed),
vLLM's ``prompt_logprobs`` on chat and completions, and lm-evaluation-harness's ``local-completions``
running a loglikelihood and a multiple-choice task over local JSONL files end to end (its
log-likelihoods equal HF's, |Δ| ≤ 1e-4)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from tests.support import ROOT, Server
from tests.support import hf_log_softmax as hf_logprobs

TOL = 1e-4
MODEL = "banyan-demo"
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "lm_eval"
TEXT = "The river bends twice before it reaches the old mill, where the water slows and the town begins."


@pytest.fixture(scope="module")
def server(demo_dir, tmp_path_factory):
    s = Server(None, tmp_path_factory.mktemp("openai_scoring") / "server.log", "--chunked-prefill-size", "32")
    yield s
    assert s.stop() == 0, s.log_text()[-3000:]


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.http_url + "/v1", api_key="none", max_retries=0, timeout=120) as c:
        yield c




def check_prompt(hf, ids: list[int], token_logprobs, top_logprobs, k: int) -> None:
    """OpenAI's echo lists for the prompt tokens: the first null, then each token's logprob and the k most
    likely (as their token strings) equal HF's."""
    ref = hf_logprobs(hf, ids)
    assert token_logprobs[0] is None and top_logprobs[0] is None
    for pos in range(1, len(ids)):
        assert abs(token_logprobs[pos] - ref[pos - 1, ids[pos]].item()) <= TOL, pos
        if k:
            best = ref[pos - 1].topk(k)
            assert len(top_logprobs[pos]) <= k
            assert abs(max(top_logprobs[pos].values()) - best.values[0].item()) <= TOL, pos


def test_echo_max_tokens_0_scores_the_prompt(client, hf):
    r = client.completions.create(model=MODEL, prompt=TEXT, max_tokens=0, echo=True, logprobs=1, temperature=0)
    c = r.choices[0]
    ids = hf[1].encode(TEXT)
    assert c.text == TEXT and c.finish_reason == "length" and r.usage.completion_tokens == 0
    assert len(c.logprobs.tokens) == len(ids) == r.usage.prompt_tokens
    check_prompt(hf, ids, c.logprobs.token_logprobs, c.logprobs.top_logprobs, 1)
    assert c.logprobs.text_offset[0] == 0 and c.logprobs.text_offset == sorted(c.logprobs.text_offset)


def test_echo_like_lm_eval_token_prompts_and_one_new_token(client, hf):
    """lm-eval's request: a batch of token-id prompts, echo, logprobs 1, max_tokens 1, temperature 0."""
    prompts = [hf[1].encode(TEXT)[:n] for n in (5, 17, 40)]
    r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=1, echo=True, logprobs=1, temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2]
    for ids, c in zip(prompts, r.choices):
        lp = c.logprobs
        assert len(lp.token_logprobs) == len(ids) + 1
        check_prompt(hf, ids, lp.token_logprobs[:-1], lp.top_logprobs[:-1], 1)
        ref = hf_logprobs(hf, ids)[-1]
        assert abs(lp.token_logprobs[-1] - ref.max().item()) <= TOL  # (greedy: the most likely token)
        assert c.text.startswith(hf[1].decode(ids, skip_special_tokens=True))  # (as skip_special_tokens says)


def test_echo_without_logprobs_and_streamed(client, hf):
    plain = client.completions.create(model=MODEL, prompt=TEXT, max_tokens=4, temperature=0, echo=True,
                                      extra_body={"ignore_eos": True})
    new = client.completions.create(model=MODEL, prompt=TEXT, max_tokens=4, temperature=0,
                                    extra_body={"ignore_eos": True}).choices[0].text
    assert plain.choices[0].text == TEXT + new and plain.choices[0].logprobs is None
    chunks = list(client.completions.create(model=MODEL, prompt=TEXT, max_tokens=4, temperature=0, echo=True,
                                            logprobs=2, stream=True, extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    tlp = [x for c in chunks if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs]
    tops = [x for c in chunks if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.top_logprobs]
    ids = hf[1].encode(TEXT)
    assert text == TEXT + new and len(tlp) == len(ids) + 4
    check_prompt(hf, ids, tlp[:len(ids)], tops[:len(ids)], 2)


def test_echo_with_n_gives_every_choice_the_prompt(client, hf):
    r = client.completions.create(model=MODEL, prompt=TEXT, max_tokens=3, echo=True, logprobs=1, n=2,
                                  temperature=1.0, seed=5)
    ids = hf[1].encode(TEXT)
    assert len(r.choices) == 2
    for c in r.choices:
        assert c.text.startswith(TEXT) and len(c.logprobs.token_logprobs) == len(ids) + 3
        check_prompt(hf, ids, c.logprobs.token_logprobs[:len(ids)], c.logprobs.top_logprobs[:len(ids)], 1)


def _check_vllm(hf, ids: list[int], entries: list, k: int) -> None:
    ref = hf_logprobs(hf, ids)
    assert len(entries) == len(ids) and entries[0] is None
    for pos in range(1, len(ids)):
        e = entries[pos]
        own = e[str(ids[pos])]
        assert abs(own["logprob"] - ref[pos - 1, ids[pos]].item()) <= TOL
        best = ref[pos - 1].topk(k)
        ranked = sorted((v for v in e.values() if v["rank"] is not None), key=lambda v: v["rank"])
        assert len(ranked) == k and [v["rank"] for v in ranked] == list(range(1, k + 1))
        for v, want in zip(ranked, best.values.tolist()):
            assert abs(v["logprob"] - want) <= TOL
        assert len(e) in (k, k + 1)  # the prompt's own token, unless it is among the k


def test_prompt_logprobs_on_completions_and_chat(client, hf):
    r = client.completions.create(model=MODEL, prompt=TEXT, max_tokens=2, temperature=0,
                                  extra_body={"prompt_logprobs": 2})
    _check_vllm(hf, hf[1].encode(TEXT), r.choices[0].model_extra["prompt_logprobs"], 2)
    msgs = [{"role": "user", "content": "Hello there"}]
    chat = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, temperature=0,
                                          extra_body={"prompt_logprobs": 1})
    ids = hf[1].apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    _check_vllm(hf, list(ids), chat.model_extra["prompt_logprobs"], 1)
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):
        client.completions.create(model=MODEL, prompt=TEXT, max_tokens=2, stream=True,
                                  extra_body={"prompt_logprobs": 1})


def _lm_eval(server, out: Path, tasks: str) -> dict:
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "OPENAI_API_KEY": "none",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p),
           "HF_DATASETS_CACHE": str(out / "datasets")}
    # no tokenizer= : lm-eval finds /tokenizer_info and tokenizes through /tokenize (its remote backend)
    args = f"model={MODEL},base_url={server.http_url}/v1/completions,num_concurrent=2,max_retries=1"
    cmd = [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", args, "--tasks", tasks,
           "--include_path", str(FIXTURES), "--output_path", str(out), "--log_samples", "--batch_size", "4"]
    run = subprocess.run(cmd, cwd=FIXTURES, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, (run.stdout[-3000:], run.stderr[-5000:])
    assert "Using remote tokenizer" in run.stderr, run.stderr[-3000:]
    samples = {}
    for f in out.rglob("samples_*.jsonl"):
        task = f.name.split("samples_", 1)[1].rsplit("_", 1)[0]
        samples[task] = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
    return samples


def _hf_loglikelihood(hf, context: str, continuation: str) -> float:
    """lm-eval's pairing: trailing spaces of the context move to the continuation; the whole and the
    context are tokenized (no special tokens) and the continuation is what the whole adds."""
    tok = hf[1]
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    whole = tok(context + continuation, add_special_tokens=False).input_ids
    ctx = tok(context, add_special_tokens=False).input_ids
    ref = hf_logprobs(hf, whole)
    return sum(ref[pos - 1, whole[pos]].item() for pos in range(len(ctx), len(whole)))


def _pairs(sample: dict) -> list[tuple[str, str]]:
    """The (context, continuation) requests lm-eval made for a document, in order."""
    args = sample["arguments"]
    return [(args[k]["arg_0"], args[k]["arg_1"]) for k in sorted(args, key=lambda k: int(k.rsplit("_", 1)[1]))]


def test_lm_eval_loglikelihood_and_multiple_choice(server, hf, tmp_path):
    samples = _lm_eval(server, tmp_path, "banyan_ll,banyan_mc")
    ll = samples["banyan_ll"]
    assert len(ll) == 4
    for s in ll:
        (context, continuation), = _pairs(s)
        assert (context, continuation) == (s["doc"]["context"], s["doc"]["continuation"])
        assert abs(float(s["resps"][0][0][0]) - _hf_loglikelihood(hf, context, continuation)) <= TOL, s
    mc = samples["banyan_mc"]
    assert len(mc) == 3
    for s in mc:
        doc, pairs = s["doc"], _pairs(s)
        assert len(pairs) == len(s["resps"]) == len(doc["choices"])
        ref = [_hf_loglikelihood(hf, c, x) for c, x in pairs]
        for resp, want in zip(s["resps"], ref):
            assert abs(float(resp[0][0]) - want) <= TOL, doc
        assert s["acc"] == float(max(range(len(ref)), key=ref.__getitem__) == doc["answer"])
