"""The measurements of benchmarks/quality.py: greedy tokens and perplexity from a Banyan server
(gRPC) and from HF transformers loading the same GGUF, question/answer checks through the OpenAI
HTTP API (plain urllib: nothing to install on the GPU host)."""

from __future__ import annotations

import json
import math
import re
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from shared.proto.banyan.v1 import generation_pb2 as pb
from shared.proto.banyan.v1 import generation_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parent.parent
QUALITY_TEXT = ROOT / "benchmarks" / "data" / "quality_text.txt"
TITLE_CHARS = 31  # the text's title line: the prompt; everything after it is scored
CHAT = ["What is the capital of France?", "Write a Python function that returns the square of a number.",
        "Name three colours of the rainbow.", "How many legs does a spider have?",
        "Give me a short tip for learning a new language.", "What is 12 plus 30?",
        "Translate 'good morning' into Spanish.", "Explain in one sentence what a lighthouse does."]
PLAIN = ["The history of the printing press begins", "def fibonacci(n):\n",
         "Once upon a time, in a small village by the sea,", "The three primary colours are",
         "import numpy as np\n\nx = np.linspace(0, 1, 11)\n",
         "Water boils at 100 degrees Celsius because", "Dear Sir or Madam,\n\nI am writing to",
         "A list of fruits: apple, banana,"]


@dataclass
class Answers:
    """What one engine produced: greedy tokens per prompt, scored token ids and their log-probs."""

    greedy: list[list[int]]
    scored_ids: list[int]
    logprobs: list[float]

    @property
    def perplexity(self) -> float:
        return math.exp(-sum(self.logprobs) / len(self.logprobs))


def chat_ids(tok, question: str) -> list[int]:
    text = tok.apply_chat_template([{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True)
    return tok.encode(text, add_special_tokens=False)


def prompts(tok) -> list[list[int]]:
    return [chat_ids(tok, q) for q in CHAT] + [tok.encode(p) for p in PLAIN]


def banyan_answers(target: str, tokens: int) -> Answers:
    import grpc

    params = pb.SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    reqs = [pb.GenerateRequest(chat=pb.ChatInput(messages=[pb.ChatMessage(role="user", content=q)]),
                               sampling_params=params) for q in CHAT]
    reqs += [pb.GenerateRequest(text=p, sampling_params=params) for p in PLAIN]
    with grpc.insecure_channel(target) as ch:
        stub = pb_grpc.GenerationServiceStub(ch)

        def one(req: pb.GenerateRequest) -> list[int]:
            return [t for resp in stub.Generate(req, timeout=600) for t in resp.token_ids]

        with ThreadPoolExecutor(len(reqs)) as pool:
            greedy = list(pool.map(one, reqs))
        text = QUALITY_TEXT.read_text()
        score = stub.Score(pb.ScoreRequest(text=text[:TITLE_CHARS], continuations=[text[TITLE_CHARS:]]), timeout=600)
    tokens_ = score.scores[0].tokens
    return Answers(greedy, [t.token_id for t in tokens_], [t.logprob for t in tokens_])


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """n greedy tokens from transformers, EOS not stopping them (the server's ignore_eos): the argmax
    each step, with transformers' own KV cache (passed by position: its keyword was renamed in 5.x)."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    out, cache, x = [], DynamicCache(), torch.tensor([ids], device=device)
    with torch.no_grad():
        for _ in range(n):
            logits = model(x, None, None, cache, use_cache=True).logits
            out.append(int(logits[0, -1].argmax()))
            x = torch.tensor([[out[-1]]], device=device)
    return out


def hf_logprobs(model, ids: list[int], scored: int, chunk: int = 256) -> list[float]:
    """transformers' log-probabilities of the last ``scored`` of ``ids``, each given all before it
    (the vocabulary projection a chunk of positions at a time, in float64)."""
    device = next(model.parameters()).device
    start = len(ids) - scored
    target = torch.tensor(ids[start:], device=device)
    out: list[float] = []
    with torch.no_grad():
        hidden = model.get_decoder()(torch.tensor([ids], device=device)).last_hidden_state[0, start - 1:-1]
        head = model.get_output_embeddings()
        for i in range(0, scored, chunk):
            logprobs = torch.log_softmax(head(hidden[i:i + chunk]).double(), -1)
            out += logprobs.gather(1, target[i:i + chunk, None])[:, 0].tolist()
    return out


def hf_answers(model, tok, tokens: int, scored: int) -> Answers:
    """transformers on the same prompts, and on the text's last ``scored`` tokens (as many as the server scored)."""
    ids = tok.encode(QUALITY_TEXT.read_text())
    return Answers([hf_greedy(model, p, tokens) for p in prompts(tok)], ids[len(ids) - scored:],
                   hf_logprobs(model, ids, scored))


def agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, float]:
    """Prompts whose greedy tokens are all equal, and the mean share of tokens equal before the first difference."""
    def prefix(x: list[int], y: list[int]) -> int:
        return next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))

    same = sum(x == y for x, y in zip(a, b))
    return {"identical_prompts": same, "prompts": len(a),
            "prefix_share": round(sum(prefix(x, y) / max(len(x), 1) for x, y in zip(a, b)) / len(a), 4)}


def _chat(url: str, model: str, question: str, **extra: Any) -> dict[str, Any]:
    body = {"model": model, "messages": [{"role": "user", "content": question}], "temperature": 0, "max_tokens": 96,
            **extra}
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        return json.loads(resp.read())


def _json_capital(r: dict[str, Any]) -> bool:
    try:
        answer = json.loads(r["choices"][0]["message"]["content"])
    except (ValueError, KeyError, TypeError):
        return False
    return "paris" in str(answer.get("capital", "")).lower() and "france" in str(answer.get("country", "")).lower()


_SCHEMA = {"type": "object", "properties": {"country": {"type": "string"}, "capital": {"type": "string"}},
           "required": ["country", "capital"], "additionalProperties": False}
# name → (question, extra request fields, check of the response)
QA: dict[str, tuple[str, dict[str, Any], Callable[[dict[str, Any]], bool]]] = {
    "capital_paris": ("What is the capital of France?", {},
                      lambda r: "Paris" in r["choices"][0]["message"]["content"]),
    "stops_at_im_end": ("What is the capital of France?", {},
                        lambda r: r["choices"][0]["finish_reason"] == "stop" and r["usage"]["completion_tokens"] < 96),
    "json_schema": ("What is the capital of France? Answer as JSON with the keys country and capital.",
                    {"response_format": {"type": "json_schema", "json_schema": {"name": "capital", "schema": _SCHEMA}}},
                    _json_capital),
    "largest_planet": ("Which planet is the largest in our solar system?", {},
                       lambda r: "Jupiter" in r["choices"][0]["message"]["content"]),
    "fibonacci_code": ("Write a recursive Python function fibonacci(n).", {"max_tokens": 160},
                       lambda r: re.search(r"def fibonacci\(n\)", r["choices"][0]["message"]["content"]) is not None),
}


def qa_checks(url: str, model: str) -> dict[str, bool]:
    out = {name: check(_chat(url, model, q, **extra)) for name, (q, extra, check) in QA.items()}
    first = _chat(url, model, "Tell me about the sea.", n=4, seed=1234, temperature=1.0, max_tokens=24)
    again = _chat(url, model, "Tell me about the sea.", n=4, seed=1234, temperature=1.0, max_tokens=24)
    texts = [[c["message"]["content"] for c in sorted(r["choices"], key=lambda c: c["index"])] for r in (first, again)]
    out["n4_seed_repeats"] = texts[0] == texts[1] and len(set(texts[0])) > 1
    return out
