"""Greedy output through the real services equals transformers ``generate``, many streams at once."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import transformers

from tests.support import Server, make_tiny_model
from shared.proto.banyan.v1 import generation_pb2 as pb
from shared.proto.banyan.v1 import generation_pb2_grpc as pb_grpc

ARCHS = ["llama", "qwen2", "qwen3"]


@pytest.fixture(scope="module", params=ARCHS)
def arch_server(request, demo_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    make_tiny_model(request.param, d, demo_dir, seed=ARCHS.index(request.param))
    server = Server(str(d), d / "server.log", "--max-prefill-tokens", "256")
    yield request.param, d, server
    assert server.stop() == 0, server.log_text()[-3000:]


TEXT = ("The river bends twice before it reaches the old mill, where the water slows and the town "
        "begins. Grüße aus Köln: 東京 and café crème, 3.14159 and 42 apples 🙂. def f(x): return x * 2 ")


def _prompts(tok) -> list[list[int]]:
    """16 prompts of 1 to 400 tokens."""
    ids = tok.encode(TEXT * 12, add_special_tokens=False)
    lengths = [1, 3, 7, 12, 20, 33, 50, 80, 120, 170, 230, 300, 5, 64, 9, 400]
    return [ids[i * 7: i * 7 + n] for i, n in enumerate(lengths)]


def _generate(stub, ids: list[int], max_tokens: int) -> tuple[list[int], pb.GenerateResponse]:
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids),
                             sampling_params=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0))
    toks, last = [], None
    for resp in stub.Generate(req, timeout=120):
        toks.extend(resp.token_ids)
        last = resp
    return toks, last


def test_greedy_matches_transformers(arch_server):
    arch, model_dir, server = arch_server
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = _prompts(tok)
    lengths = [8 + (i * 5) % 17 for i in range(len(prompts))]
    with server.channel() as ch, ThreadPoolExecutor(len(prompts)) as pool:
        stub = pb_grpc.GenerationServiceStub(ch)
        eos = set(stub.GetModelInfo(pb.GetModelInfoRequest()).eos_token_ids)
        results = list(pool.map(lambda a: _generate(stub, *a), zip(prompts, lengths)))
    for ids, n, (got, last) in zip(prompts, lengths, results):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=n,
                              attention_mask=torch.ones(1, len(ids), dtype=torch.long), pad_token_id=0)
        want = ref[0, len(ids):].tolist()
        assert got == want, f"{arch}: prompt of {len(ids)} tokens"
        assert last.usage.prompt_tokens == len(ids)
        assert last.usage.completion_tokens == len(got)
        stopped = got[-1] in eos
        assert len(got) == n or stopped
        assert last.finish_reason == (pb.FINISH_REASON_STOP if stopped else pb.FINISH_REASON_LENGTH)
