"""Data parallelism end to end: ``banyan serve --dp 2 --num-tokenizers 2`` runs two scheduler +
worker groups; the tokenizers route each request by prefix affinity and load. Requests sharing a
prefix land in one group (its `routed` lines, the scheduler that queued them, per-group cache
counters, usage.cached_tokens), unrelated prefixes spread over both, both tokenizer replicas pick
the same group for a prefix, greedy outputs and scores equal those of ``--dp 1``, aborts and
cancels free the KV, and the aggregate APIs (GetLoad, GetModelInfo, health, metrics) see both."""

from __future__ import annotations

import random
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.support import Server, make_tiny_model
from shared.proto.banyan.v1 import generation_pb2 as pb
from shared.proto.banyan.v1 import generation_pb2_grpc as pb_grpc

PREFIX = 256  # tokens shared by a family of requests (8 router blocks of 32)


@pytest.fixture(scope="module")
def model_dir(demo_dir, tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("llama-dp")
    make_tiny_model("llama", d, demo_dir, seed=7)
    return str(d)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    s = Server(model_dir, tmp_path_factory.mktemp("dp2") / "server.log", "--dp", "2", "--num-tokenizers", "2")
    yield s
    assert s.stop() == 0, s.log_text()[-3000:]


@pytest.fixture(scope="module")
def single(model_dir, tmp_path_factory):
    s = Server(model_dir, tmp_path_factory.mktemp("dp1") / "server.log")
    yield s
    assert s.stop() == 0, s.log_text()[-3000:]


def ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 1900) for _ in range(n)]


def run(stub, prompt: list[int], rid: str, max_tokens: int = 8, **sp) -> list[pb.GenerateResponse]:
    sp = {"temperature": 0.0, **sp}
    req = pb.GenerateRequest(request_id=rid, token_ids=pb.TokenIds(ids=prompt),
                             sampling_params=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sp))
    return list(stub.Generate(req, timeout=120))


def tokens(resps, index: int = 0) -> list[int]:
    return [t for r in resps if r.index == index for t in r.token_ids]


def cached(resps) -> int:
    return [r for r in resps if r.finish_reason][-1].usage.cached_tokens


def stages(server: Server, name: str, rids) -> dict[str, dict]:
    """The ``name`` stage line of each request id (after every line has been written)."""
    rids = set(rids)
    for _ in range(100):
        got = {r["request_id"]: r for r in server.log_records()
               if r.get("event") == "stage" and r.get("stage") == name and r.get("request_id") in rids}
        if len(got) == len(rids):
            return got
        time.sleep(0.1)
    raise AssertionError(f"missing {name} lines: {sorted(rids - set(got))}")


def groups_of(server: Server, rids) -> dict[str, int]:
    """request id → the group its tokenizer routed it to, checked against the scheduler that queued it."""
    routed = stages(server, "routed", rids)
    queued = stages(server, "queued", rids)
    scheduler_pid = {r["pid"]: int(r["process"].split("-")[1]) for r in server.log_records()
                     if r.get("event") == "started" and r.get("process", "").startswith("scheduler-")}
    for rid in rids:
        assert scheduler_pid[queued[rid]["pid"]] == routed[rid]["group"], (routed[rid], queued[rid])
    return {rid: routed[rid]["group"] for rid in rids}


def load(stub) -> pb.GetLoadResponse:
    return stub.GetLoad(pb.GetLoadRequest())


def idle(stub) -> pb.GetLoadResponse:
    """GetLoad once no group runs anything and every KV slot is free or reclaimable."""
    for _ in range(200):
        l = load(stub)
        if all(g.num_running_requests == g.num_waiting_requests == 0
               and g.kv_free_tokens + g.kv_evictable_tokens == g.kv_pool_tokens for g in l.groups):
            return l
        time.sleep(0.05)
    raise AssertionError(f"the groups never became idle: {l}")


def test_each_group_gets_its_own_gpus(monkeypatch):
    import torch

    from banyan.launcher import _group_gpus
    from shared.config import WorkerConfig

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    tp2 = WorkerConfig(tp_size=2, dist_init_addr="127.0.0.1:1")
    assert _group_gpus(tp2, 2) == [{"CUDA_VISIBLE_DEVICES": "0,1"}, {"CUDA_VISIBLE_DEVICES": "2,3"}]
    assert _group_gpus(WorkerConfig(), 1) == [{}]  # dp 1: untouched
    assert _group_gpus(WorkerConfig(device="cuda:1"), 2) == [{}, {}]  # an explicit device is shared
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,6,7")
    assert _group_gpus(WorkerConfig(device="cuda"), 4) == [{"CUDA_VISIBLE_DEVICES": d} for d in "3567"]
    with pytest.raises(RuntimeError, match="needs 6 GPUs"):
        _group_gpus(tp2, 3)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert _group_gpus(WorkerConfig(), 2) == [{}, {}]  # no GPU: every group on the CPU


def test_serving_info_load_health_and_metrics(server, stub):
    info = stub.GetModelInfo(pb.GetModelInfoRequest())
    assert info.data_parallel_size == 2 and info.kv_pool_tokens > 0
    with server.channel() as ch:
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    l = load(stub)
    assert len(l.groups) == 2 and not any(g.groups for g in l.groups)
    for f in ("kv_pool_tokens", "kv_free_tokens", "prefill_computed_tokens", "steps", "decode_tokens"):
        assert getattr(l, f) == sum(getattr(g, f) for g in l.groups), f
    assert all(g.kv_pool_tokens == info.kv_pool_tokens for g in l.groups)  # the same pool size in each group
    lines = server.log_path.with_suffix(".ready").read_text().split()
    sched_ports, worker_ports = lines[4].split(","), lines[5].split(",")
    assert len(set(sched_ports)) == 2 and len(set(worker_ports)) == 2 and sched_ports[0] == lines[2]
    for port in sched_ports + worker_ports:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            assert b"banyan:" in r.read()


def test_prefix_families_stay_in_one_group_and_spread_over_both(server, stub):
    families, followers = 6, 3
    before = idle(stub)
    heads = {f"fam{f}-0": ids(100 + f, PREFIX) + ids(200 + f, 16) for f in range(families)}
    for rid, prompt in heads.items():  # one request per family first: its prefix gets cached
        assert cached(run(stub, prompt, rid)) == 0
    rest = {f"fam{f}-{i}": ids(100 + f, PREFIX) + ids(300 + 10 * f + i, 16)
            for f in range(families) for i in range(1, followers + 1)}
    with ThreadPoolExecutor(8) as pool:  # the followers at once, families interleaved
        hits = dict(zip(rest, pool.map(lambda kv: cached(run(stub, kv[1], kv[0])), rest.items())))
    where = groups_of(server, [*heads, *rest])
    family_groups = [{where[r] for r in where if r.startswith(f"fam{f}-")} for f in range(families)]
    assert all(len(g) == 1 for g in family_groups), family_groups  # a family never splits
    assert {g for (g,) in family_groups} == {0, 1}, "unrelated prefixes must use both groups"
    # every follower found its family's prefix in its group: what perfect affinity gives
    assert all(h >= PREFIX for h in hits.values()), hits
    after = idle(stub)
    for g in (0, 1):
        fams = [f for f in range(families) if family_groups[f] == {g}]
        got = after.groups[g].prefill_cached_tokens - before.groups[g].prefill_cached_tokens
        assert got == sum(h for r, h in hits.items() if int(r[3:r.index("-")]) in fams)
    print(f"\ndp=2 routing: cached {sum(hits.values())} prompt tokens of {families * followers} followers; "
          f"perfect affinity: >= {families * followers * PREFIX}; families per group "
          f"{[sum(1 for fg in family_groups if fg == {g}) for g in (0, 1)]}")


def test_parallel_samples_stay_in_one_group(server, stub):
    before = idle(stub)
    prompt = ids(7, 120)
    resps = run(stub, prompt, "n3", max_tokens=6, n=3, temperature=1.0, seed=3)
    assert sorted({r.index for r in resps}) == [0, 1, 2]
    (g,) = set(groups_of(server, ["n3"]).values())
    after = idle(stub)
    computed = [a.prefill_computed_tokens - b.prefill_computed_tokens for a, b in zip(after.groups, before.groups)]
    assert computed[g] >= 120 and computed[1 - g] == 0  # all branches in one group (one `routed` line)
    assert len([r for r in server.log_records() if r.get("stage") == "routed" and r["request_id"] == "n3"]) == 1


def test_two_tokenizer_replicas_route_a_prefix_to_the_same_group(server):
    by_pid: dict[int, grpc.Channel] = {}
    spare = []
    for i in range(40):  # the kernel spreads new connections over the replicas
        ch = server.channel(own_connection=True)
        run(pb_grpc.GenerationServiceStub(ch), ids(900 + i, 4), f"who-{i}", max_tokens=1)
        pid = stages(server, "received", [f"who-{i}"])[f"who-{i}"]["pid"]
        (spare if pid in by_pid else by_pid.__setitem__(pid, ch) or []).append(ch)
        if len(by_pid) == 2:
            break
    try:
        assert len(by_pid) == 2, "both tokenizer replicas must be reachable"
        a, b = (pb_grpc.GenerationServiceStub(ch) for ch in by_pid.values())
        for f in range(6):
            prefix = ids(500 + f, PREFIX)
            run(a, prefix + [1, 2], f"rep-a{f}")
            hit = cached(run(b, prefix + [3, 4], f"rep-b{f}"))
            where = groups_of(server, [f"rep-a{f}", f"rep-b{f}"])
            assert where[f"rep-a{f}"] == where[f"rep-b{f}"]
            assert hit >= PREFIX  # replica b found it where replica a had sent it
            routed = stages(server, "routed", [f"rep-b{f}"])[f"rep-b{f}"]
            assert routed["reason"] == "hash"  # b had not seen it: the shared rendezvous order chose
    finally:
        for ch in [*by_pid.values(), *spare]:
            ch.close()


def test_abort_and_cancel_free_the_kv(server, stub):
    idle(stub)
    stream = stub.Generate(pb.GenerateRequest(request_id="dp-abort", token_ids=pb.TokenIds(ids=ids(11, 64)),
                                              sampling_params=pb.SamplingParams(max_tokens=900, ignore_eos=True)),
                           timeout=120)
    next(stream)  # running
    assert stub.Abort(pb.AbortRequest(request_id="dp-abort")).found
    rest = list(stream)
    assert rest[-1].finish_reason == pb.FINISH_REASON_ABORT
    stream = stub.Generate(pb.GenerateRequest(request_id="dp-cancel", token_ids=pb.TokenIds(ids=ids(12, 64)),
                                              sampling_params=pb.SamplingParams(max_tokens=900, ignore_eos=True)),
                           timeout=120)
    next(stream)
    stream.cancel()
    groups_of(server, ["dp-abort", "dp-cancel"])
    idle(stub)  # both groups: nothing running, every slot free or cached


def test_outputs_and_scores_equal_dp1(server, stub, single):
    prompts = [ids(20 + i, 40 + 30 * i) for i in range(6)] + [ids(20, 40) + ids(40, 24)]
    with single.channel() as ch:
        s1 = pb_grpc.GenerationServiceStub(ch)
        want = [tokens(run(s1, p, f"one-{i}", max_tokens=12)) for i, p in enumerate(prompts)]
        score_req = pb.ScoreRequest(request_id="sc", token_ids=pb.TokenIds(ids=ids(30, 80)),
                                    continuations=[" yes", " no", " maybe later"])
        want_scores = s1.Score(score_req, timeout=120)
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda ip: tokens(run(stub, ip[1], f"two-{ip[0]}", max_tokens=12)), enumerate(prompts)))
    assert got == want
    assert len(set(groups_of(server, [f"two-{i}" for i in range(len(prompts))]).values())) == 2
    scores = stub.Score(score_req, timeout=120)
    assert len(set(groups_of(server, ["sc.0", "sc.1", "sc.2"]).values())) == 1  # one group: one prompt prefill
    for a, b in zip(scores.scores, want_scores.scores):
        assert [t.token_id for t in a.tokens] == [t.token_id for t in b.tokens]
        assert a.logprob_sum == pytest.approx(b.logprob_sum, abs=1e-4)
