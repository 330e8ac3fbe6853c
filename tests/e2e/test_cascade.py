"""Shared-prefix (cascade) attention end to end: requests under one cached system prompt and the
branches of an n > 1 request are grouped (the scheduler's metrics count the steps and the KV
reads saved), and greedy outputs equal those of a server with cascade attention off."""

from __future__ import annotations

import random
import re
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.support import Server, make_tiny_model
from shared.proto.banyan.v1 import generation_pb2 as pb
from shared.proto.banyan.v1 import generation_pb2_grpc as pb_grpc

rng = random.Random(11)
SYSTEM = [rng.randrange(10, 250) for _ in range(300)]
QUESTIONS = [SYSTEM + [rng.randrange(10, 250) for _ in range(20 + i)] for i in range(6)]
BRANCHED = [rng.randrange(10, 250) for _ in range(200)]


@pytest.fixture(scope="module")
def model_dir(demo_dir, tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("llama-cascade")
    make_tiny_model("llama", d, demo_dir, seed=7, max_positions=2048)
    return str(d)


def serve(model_dir, path, *flags) -> Server:
    return Server(model_dir, path / "server.log", *flags)


def generate(stub, ids, n=1) -> dict[int, list[int]]:
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), sampling_params=pb.SamplingParams(
        max_tokens=24, ignore_eos=True, temperature=0.0, n=n))
    out: dict[int, list[int]] = {}
    for r in stub.Generate(req, timeout=120):
        out.setdefault(r.index, []).extend(r.token_ids)
    return out


def workload(server: Server) -> list[dict[int, list[int]]]:
    with server.channel() as ch:
        stub = pb_grpc.GenerationServiceStub(ch)
        generate(stub, SYSTEM + [1])  # the system prompt in the cache
        with ThreadPoolExecutor(8) as pool:
            futs = [pool.submit(generate, stub, q) for q in QUESTIONS] + [pool.submit(generate, stub, BRANCHED, 4)]
            return [f.result() for f in futs]


def counter(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert m, f"{name} missing from /metrics"
    return float(m.group(1))


def test_grouped_outputs_equal_plain(model_dir, tmp_path_factory):
    on = serve(model_dir, tmp_path_factory.mktemp("cascade-on"), "--cascade-min-group", "2",
               "--cascade-min-prefix", "16", "--cascade-min-saved", "0", "--cascade-min-saved-eager", "0")
    try:
        got = workload(on)
        metrics, worker_metrics = on.metrics("scheduler"), on.metrics("worker")
        with on.channel() as ch:
            load = pb_grpc.GenerationServiceStub(ch).GetLoad(pb.GetLoadRequest())
    finally:
        assert on.stop() == 0, on.log_text()[-3000:]
    off = serve(model_dir, tmp_path_factory.mktemp("cascade-off"), "--disable-cascade-attention")
    try:
        want = workload(off)
        off_metrics = off.metrics("scheduler")
    finally:
        assert off.stop() == 0, off.log_text()[-3000:]
    assert got == want
    assert all(len(t) == 24 for outs in got for t in outs.values()) and len(got[-1]) == 4
    steps, saved = counter(metrics, "banyan:cascade_steps_total"), counter(metrics, "banyan:cascade_saved_tokens_total")
    # every decode step of the 6 questions could group them on the 300-token prefix; the 4 branches
    # share their 199-token prompt the same way
    assert steps >= 20 and saved >= steps * 199
    assert counter(worker_metrics, "banyan:cascade_steps_total") == steps  # the worker ran every one grouped
    assert counter(off_metrics, "banyan:cascade_steps_total") == 0
    # the start-up heaps (torch, transformers, xgrammar) frozen out of the collector's walk, pauses reported
    for text in (metrics, worker_metrics):
        assert counter(text, "banyan:gc_frozen_objects") > 10_000
        assert 'banyan:gc_pause_seconds_count{generation="2"}' in text
    assert load.num_running_requests == 0 and load.kv_free_tokens + load.kv_evictable_tokens == load.kv_pool_tokens
