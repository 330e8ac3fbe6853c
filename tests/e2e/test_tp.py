"""Tensor parallelism through the real services: ``banyan serve --tp 2`` (two gloo worker ranks on
the CPU) generates the same greedy tokens as ``--tp 1``, prefill chunks and decodes batched, and
with shared-prefix (cascade) attention on the TP 2 side only."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.support import Server, make_tiny_model
from shared.proto.banyan.v1 import generation_pb2 as pb
from shared.proto.banyan.v1 import generation_pb2_grpc as pb_grpc

PROMPTS = [[(7 * i + 3 * j) % 500 + 5 for j in range(n)] for i, n in enumerate([1, 4, 9, 17, 30, 55, 90, 140, 6, 64])]


@pytest.fixture(scope="module")
def servers(demo_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("tp")
    make_tiny_model("llama", d, demo_dir, seed=3)
    args = ("--max-prefill-tokens", "64", "--max-running-requests", "6")  # chunked prefill next to decodes
    tp1 = Server(str(d), d / "tp1.log", *args, "--tp", "1", "--disable-cascade-attention")
    tp2 = Server(str(d), d / "tp2.log", *args, "--tp", "2", "--cascade-min-group", "2", "--cascade-min-prefix", "8",
                 "--cascade-min-saved", "0", "--cascade-min-saved-eager", "0")
    yield tp1, tp2
    for s in (tp1, tp2):
        assert s.stop() == 0, s.log_text()[-3000:]


def _greedy(server: Server, ids: list[int], n: int) -> list[int]:
    with server.channel() as ch:
        req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), sampling_params=pb.SamplingParams(
            max_tokens=n, temperature=0.0, ignore_eos=True))
        return [t for resp in pb_grpc.GenerationServiceStub(ch).Generate(req, timeout=120) for t in resp.token_ids]


def test_tp2_greedy_matches_tp1(servers):
    tp1, tp2 = servers
    lengths = [12 + 3 * i for i in range(len(PROMPTS))]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        want = list(pool.map(lambda a: _greedy(tp1, *a), zip(PROMPTS, lengths)))
        got = list(pool.map(lambda a: _greedy(tp2, *a), zip(PROMPTS, lengths)))
    assert [len(w) for w in want] == lengths
    assert got == want
    ranks = {r.get("tp_rank") for r in tp2.log_records() if r.get("event") == "model_loaded"}
    assert ranks == {0, 1}


def test_tp2_with_shared_prefix_groups_matches_tp1(servers):
    tp1, tp2 = servers
    system = [(11 * j) % 400 + 20 for j in range(48)]
    prompts = [system + [(5 * i + j) % 300 + 9 for j in range(3 + i)] for i in range(5)]
    for s in (tp1, tp2):
        _greedy(s, system + [1], 1)  # the shared prefix in the cache
    with ThreadPoolExecutor(len(prompts)) as pool:
        want = list(pool.map(lambda p: _greedy(tp1, p, 16), prompts))
        got = list(pool.map(lambda p: _greedy(tp2, p, 16), prompts))
    assert got == want and all(len(w) == 16 for w in want)
    steps = [line for line in tp2.metrics("worker").splitlines() if line.startswith("banyan:cascade_steps_total ")]
    assert steps and float(steps[0].split()[1]) > 0  # the TP 2 ranks ran grouped steps
