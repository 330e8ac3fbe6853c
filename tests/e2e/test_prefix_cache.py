"""RadixAttention end to end: shared prefixes are computed once, memory pressure evicts and
retracts without changing greedy outputs, n > 1 shares the prompt, and the pool ends whole."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.support import Server, make_tiny_model
from shared.proto.banyan.v1 import generation_pb2 as pb
from shared.proto.banyan.v1 import generation_pb2_grpc as pb_grpc


@pytest.fixture(scope="module")
def model_dir(demo_dir, tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("llama-2k")
    make_tiny_model("llama", d, demo_dir, seed=5, max_positions=2048)
    return str(d)


@pytest.fixture(scope="module")
def big(model_dir, tmp_path_factory):
    s = Server(model_dir, tmp_path_factory.mktemp("big") / "server.log", "--chunked-prefill-size", "256")
    yield s
    assert s.stop() == 0, s.log_text()[-3000:]


@pytest.fixture(scope="module")
def small(model_dir, tmp_path_factory):
    """A pool of 640 tokens: 8 concurrent requests of 40 + 120 tokens cannot all fit."""
    s = Server(model_dir, tmp_path_factory.mktemp("small") / "server.log", "--max-total-tokens", "640",
               "--schedule-policy", "dfs-weight")
    yield s
    assert s.stop() == 0, s.log_text()[-3000:]


def load(stub) -> pb.GetLoadResponse:
    return stub.GetLoad(pb.GetLoadRequest())


def run(stub, ids, max_tokens=16, salt="", **sp) -> list[pb.GenerateResponse]:
    sp = {"temperature": 0.0, **sp}
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), cache_salt=salt, sampling_params=pb.SamplingParams(
        max_tokens=max_tokens, ignore_eos=True, **sp))
    return list(stub.Generate(req, timeout=120))


def tokens(resps, index=0) -> list[int]:
    return [t for r in resps if r.index == index for t in r.token_ids]


def final(resps, index=0) -> pb.GenerateResponse:
    return [r for r in resps if r.index == index][-1]


def whole(l: pb.GetLoadResponse) -> bool:
    return l.num_running_requests == 0 and l.kv_free_tokens + l.kv_evictable_tokens == l.kv_pool_tokens


def test_shared_prefix_computes_only_the_suffix(big):
    rng = random.Random(1)
    prefix = [rng.randrange(10, 1900) for _ in range(1000)]
    a, b = prefix + [7] * 20, prefix + [8] * 20
    with big.channel() as ch:
        stub = pb_grpc.GenerationServiceStub(ch)
        run(stub, a)
        before = load(stub)
        warm = run(stub, b)
        after = load(stub)
        assert after.prefill_computed_tokens - before.prefill_computed_tokens == 20
        assert after.prefill_cached_tokens - before.prefill_cached_tokens == 1000
        assert final(warm).usage.cached_tokens == 1000
        cold = run(stub, b, salt="another-tenant")  # a namespace of its own: nothing to reuse
        assert final(cold).usage.cached_tokens == 0
        assert tokens(warm) == tokens(cold) and len(tokens(warm)) == 16
        assert whole(load(stub))


def test_parallel_sampling_computes_the_prompt_once(big):
    rng = random.Random(2)
    prompt = [rng.randrange(10, 1900) for _ in range(200)]
    with big.channel() as ch:
        stub = pb_grpc.GenerationServiceStub(ch)
        before = load(stub)
        resps = run(stub, prompt, max_tokens=12, n=4)
        after = load(stub)
        assert sorted({r.index for r in resps}) == [0, 1, 2, 3]
        # the prompt once, plus the last prompt token of each other branch (its logits are needed)
        assert after.prefill_computed_tokens - before.prefill_computed_tokens == 200 + 3
        assert sorted(final(resps, i).usage.cached_tokens for i in range(4)) == [0, 199, 199, 199]
        assert all(len(tokens(resps, i)) == 12 for i in range(4))
        sampled = run(stub, prompt + [3], max_tokens=12, n=3, seed=5, temperature=1.0)
        outs = [tokens(sampled, i) for i in range(3)]
        assert len({tuple(o) for o in outs}) > 1, "branches must sample independently"
        again = run(stub, prompt + [3], max_tokens=12, n=3, seed=5, temperature=1.0)
        assert [tokens(again, i) for i in range(3)] == outs, "seeded branches are reproducible"


def _pressure_prompts() -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(10, 1900) for _ in range(40)] for _ in range(8)]


def test_memory_pressure_retracts_and_keeps_outputs(big, small):
    prompts = _pressure_prompts()
    with big.channel() as ch:
        stub = pb_grpc.GenerationServiceStub(ch)
        want = [tokens(run(stub, p, max_tokens=120)) for p in prompts]
    with small.channel() as ch, ThreadPoolExecutor(8) as pool:
        stub = pb_grpc.GenerationServiceStub(ch)
        got = list(pool.map(lambda p: tokens(run(stub, p, max_tokens=120)), prompts))
        l = load(stub)
    assert got == want
    assert l.retractions > 0, "a 640-token pool cannot hold 8 × 160 tokens: retraction must have happened"
    assert l.evicted_tokens > 0
    assert whole(l)
