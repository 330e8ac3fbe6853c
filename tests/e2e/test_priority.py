"""Priority scheduling end to end (``--enable-priority-scheduling``) on the demo model.

- Under a saturating flood of priority-0 requests a priority-10 request starts before every
  priority-0 request that was waiting when it arrived (the scheduler's own log order), preempting
  a running one; the preempted request resumes and its greedy output equals a run on its own.
- Its TTFT under the flood stays within 2x its TTFT on the idle server (medians of 3 fresh
  prompts long enough that their prefill dominates; the flood's streams are not read, so the
  client does not compete for the 2 cores).
- Aging: a priority-0 request that waited ``--priority-aging-seconds`` goes ahead of priority-10
  requests queued before it started; a full queue sheds its lowest-priority request for a higher
  one (RESOURCE_EXHAUSTED for the shed one, and for a newcomer no higher than the queue).
- Bad priorities are INVALID_ARGUMENT / 400 (body, header, both disagreeing).
"""

from __future__ import annotations

import json
import random
import statistics
import threading
import time
import urllib.error
import urllib.request

import grpc
import pytest

from tests.support import Server
from shared.proto.banyan.v1 import generation_pb2 as pb
from shared.proto.banyan.v1 import generation_pb2_grpc as pb_grpc

RUNNING = 2  # --max-running-requests of the main server


@pytest.fixture(scope="module")
def server(demo_dir, tmp_path_factory):
    s = Server(None, tmp_path_factory.mktemp("priority") / "server.log", "--enable-priority-scheduling",
               "--max-running-requests", str(RUNNING), "--priority-aging-seconds", "0")
    yield s
    assert s.stop() == 0, s.log_text()[-3000:]


@pytest.fixture(scope="module")
def aging(demo_dir, tmp_path_factory):
    """One request at a time, three queued at most, aging after 1 s, no preemption."""
    s = Server(None, tmp_path_factory.mktemp("aging") / "server.log", "--enable-priority-scheduling",
               "--max-running-requests", "1", "--max-queued-requests", "3", "--priority-aging-seconds", "1",
               "--priority-preemption-threshold", "0")
    yield s
    assert s.stop() == 0, s.log_text()[-3000:]


def ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 1990) for _ in range(n)]


def request(prompt: list[int], max_tokens: int, priority: int = 0, rid: str = "", salt: str = "") -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id=rid, token_ids=pb.TokenIds(ids=prompt), priority=priority, cache_salt=salt,
                              sampling_params=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                ignore_eos=True))


def tokens(stub, req: pb.GenerateRequest) -> list[int]:
    return [t for r in stub.Generate(req, timeout=300) for t in r.token_ids]


def ttft(stub, req: pb.GenerateRequest) -> float:
    t0 = time.perf_counter()
    stream = stub.Generate(req, timeout=300)
    try:
        for r in stream:
            if r.token_ids:
                return time.perf_counter() - t0
    finally:
        stream.cancel()
    raise AssertionError("no token")


def load(stub) -> pb.GetLoadResponse:
    return stub.GetLoad(pb.GetLoadRequest(), timeout=30)


def wait_for(cond, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def scheduler_stages(server: Server) -> list[dict]:
    """The scheduler's stage lines, in the order it wrote them."""
    return [r for r in server.log_records() if r.get("service") == "scheduler" and "stage" in r]


def test_priority_request_overtakes_the_queue_and_preempts_with_identical_resumed_output(server):
    rng = random.Random(1)
    flood = [ids(rng, 32) for _ in range(8)]  # 2 run, 6 queue; each runs 120 steps
    with server.channel() as ch:
        stub = pb_grpc.GenerationServiceStub(ch)
        # what each flood request generates on its own (another cache namespace: nothing reused later)
        alone = [tokens(stub, request(p, 120, salt="reference")) for p in flood]
        outs: dict[str, list[int]] = {}

        def run(i: int) -> None:
            outs[f"flood-{i}"] = tokens(stub, request(flood[i], 120, 0, f"flood-{i}"))

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(flood))]
        for t in threads:
            t.start()
        wait_for(lambda: (lambda l: l.num_running_requests == RUNNING and l.num_waiting_requests >= 4)(load(stub)),
                 "the flood to fill the running slots and queue the rest")
        urgent = tokens(stub, request(ids(rng, 24), 4, 10, "urgent"))
        for t in threads:
            t.join(120)
        final = load(stub)
    assert len(urgent) == 4 and final.preemptions >= 1
    stages = scheduler_stages(server)
    pos = {(r["stage"], r["request_id"]): i for i, r in reversed(list(enumerate(stages)))}  # first occurrence
    arrived = pos[("queued", "urgent")]
    waiting = [f"flood-{i}" for i in range(len(flood)) if pos[("scheduled", f"flood-{i}")] > arrived]
    assert len(waiting) >= 4, waiting  # (the flood's tail was queued when it arrived)
    started = pos[("scheduled", "urgent")]
    assert all(pos[("scheduled", rid)] > started for rid in waiting), "a waiting priority-0 request went first"
    preempted = {r["request_id"] for r in stages if r["stage"] == "preempted" and r.get("by") == "urgent"}
    assert len(preempted) == 1 and preempted <= {f"flood-{i}" for i in range(len(flood))}
    # everyone finished, the preempted one included, with the output it has on its own
    assert all(outs[f"flood-{i}"] == alone[i] for i in range(len(flood)))


def test_ttft_under_a_saturating_flood_stays_within_twice_idle(server):
    """Idle and flooded measurements alternate (3 rounds), so a change in the machine's other load
    affects both alike; every prompt is fresh (no cache hit) and long enough for its prefill to
    dominate a TTFT."""
    rng = random.Random(2)
    prompt_len = 1000
    idle, busy = [], []
    with server.channel() as ch:
        stub = pb_grpc.GenerationServiceStub(ch)
        before = load(stub).preemptions
        for round_ in range(3):
            wait_for(lambda: (lambda l: l.num_running_requests + l.num_waiting_requests == 0)(load(stub)), "idle")
            idle.append(ttft(stub, request(ids(rng, prompt_len), 2, 10)))
            calls = [stub.Generate(request(ids(rng, 32), 3000, 0, f"bg-{round_}-{i}"), timeout=300) for i in range(6)]
            try:  # (the flood's streams are not read: the client stays off the CPU)
                wait_for(lambda: (lambda l: (l.num_running_requests, l.num_waiting_requests) == (RUNNING, 4))(
                    load(stub)), "the flood to saturate the server")
                busy.append(ttft(stub, request(ids(rng, prompt_len), 2, 10, f"hi-{round_}")))
                # (still saturated: all six flood requests are alive; the running count alone races with
                # hi's second token, after which the preempted one waits for the next step to resume)
                now = load(stub)
                assert now.num_running_requests + now.num_waiting_requests >= 6, now
            finally:
                for c in calls:
                    c.cancel()
        after = load(stub)
    assert after.preemptions - before >= 3  # the slots were full each time: it preempted
    # structurally: each started in the first step built after it arrived (nothing else was admitted
    # in between), preempting a flood request for its slot; so its TTFT is its prefill plus the steps
    # already in flight
    stages = scheduler_stages(server)
    for round_ in range(3):
        rid = f"hi-{round_}"
        q = next(i for i, r in enumerate(stages) if r["request_id"] == rid and r["stage"] == "queued")
        sched = next(i for i, r in enumerate(stages) if r["request_id"] == rid and r["stage"] == "scheduled")
        between = [r["stage"] for r in stages[q + 1:sched]]
        assert "scheduled" not in between and between.count("preempted") >= 1, between
    ratio = statistics.median(busy) / statistics.median(idle)
    print(f"TTFT idle {[round(x * 1e3) for x in idle]} ms, under the flood {[round(x * 1e3) for x in busy]} ms: "
          f"median ratio {ratio:.2f}")
    assert ratio <= 2.0, (idle, busy)


def test_metrics_by_priority(server):
    text = server.metrics("scheduler")

    def sample(name: str, **labels) -> float:
        want = "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else ""
        line = next(x for x in text.splitlines() if x.startswith(name + want + " "))
        return float(line.split()[-1])

    assert sample("banyan:priority_time_to_first_token_seconds_count", priority="10") >= 7
    assert sample("banyan:priority_time_to_first_token_seconds_count", priority="0") >= 8
    assert sample("banyan:preemptions_total") >= 4  # (1 + 3 by the tests above)
    assert sample("banyan:priority_urgent_steps_total") >= 1  # an urgent admission while the flood decoded
    assert 'banyan:priority_running_requests{priority="0"}' in text
    assert 'banyan:priority_waiting_requests{priority="10"}' in text


def test_aging_lets_a_low_priority_request_ahead_of_later_high_ones(aging):
    rng = random.Random(3)
    with aging.channel() as ch:
        stub = pb_grpc.GenerationServiceStub(ch)
        first = stub.Generate(request(ids(rng, 16), 400, 10, "first"), timeout=300)
        wait_for(lambda: load(stub).num_running_requests == 1, "the first request to run")
        calls = [stub.Generate(request(ids(rng, 16), 4, 0, "low"), timeout=300)]
        wait_for(lambda: load(stub).num_waiting_requests == 1, "the low-priority request to queue")
        calls += [stub.Generate(request(ids(rng, 16), 400, 10, f"high-{i}"), timeout=300) for i in range(2)]
        for c in [first, *calls]:
            list(c)
    stages = scheduler_stages(aging)
    order = [r["request_id"] for r in stages if r["stage"] == "scheduled"]
    # strict priority would run high-0 and high-1 first; after 1 s of waiting "low" goes ahead of them
    assert order.index("low") < order.index("high-1"), order
    assert order[0] == "first"


def test_a_full_queue_sheds_its_lowest_priority_request(aging):
    rng = random.Random(4)
    with aging.channel() as ch:
        stub = pb_grpc.GenerationServiceStub(ch)
        calls = [stub.Generate(request(ids(rng, 16), 3000, 0, "busy"), timeout=300)]
        wait_for(lambda: load(stub).num_running_requests == 1, "a running request")
        try:
            for i in range(3):
                calls.append(stub.Generate(request(ids(rng, 16), 8, i, f"w{i}"), timeout=300))
                wait_for(lambda: load(stub).num_waiting_requests == i + 1, "a queued request")
            calls.append(stub.Generate(request(ids(rng, 16), 8, 5, "urgent"), timeout=300))
            with pytest.raises(grpc.RpcError) as shed:
                list(calls[1])  # w0: the lowest priority
            assert shed.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "shed" in shed.value.details()
            assert load(stub).num_waiting_requests == 3
            with pytest.raises(grpc.RpcError) as refused:  # no higher than anything queued: refused itself
                list(stub.Generate(request(ids(rng, 16), 8, 1, "late"), timeout=60))
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "queue is full" in refused.value.details()
            body = json.dumps({"prompt": ids(rng, 8), "max_tokens": 2, "priority": -5}).encode()
            with pytest.raises(urllib.error.HTTPError) as h:
                urllib.request.urlopen(urllib.request.Request(f"{aging.http_url}/v1/completions", data=body,
                                                              headers={"Content-Type": "application/json"}), timeout=60)
            assert h.value.code == 429
            assert load(stub).shed_requests == 1
        finally:
            for c in calls:
                c.cancel()


@pytest.mark.parametrize("priority", [1001, -1001, 2**31 - 1])
def test_grpc_priority_out_of_range_is_invalid_argument(stub, priority):
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(request([5, 6, 7], 2, priority), timeout=60))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "priority" in e.value.details()


@pytest.mark.parametrize("body, headers, field", [
    ({"priority": 5000}, {}, "priority"),
    ({"priority": "high"}, {}, "priority"),
    ({}, {"x-banyan-priority": "urgent"}, "x-banyan-priority"),
    ({}, {"x-banyan-priority": "-2000"}, "x-banyan-priority"),
    ({"priority": 3}, {"x-banyan-priority": "4"}, "disagree"),
])
def test_http_bad_priority_is_400(server, body, headers, field):
    data = json.dumps({"prompt": "Hi", "max_tokens": 2, **body}).encode()
    req = urllib.request.Request(f"{server.http_url}/v1/completions", data=data,
                                 headers={"Content-Type": "application/json", **headers})
    with pytest.raises(urllib.error.HTTPError) as h:
        urllib.request.urlopen(req, timeout=60)
    assert h.value.code == 400 and field in json.loads(h.value.read())["error"]["message"]


def test_http_priority_header_is_taken(server):
    data = json.dumps({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}).encode()
    req = urllib.request.Request(f"{server.http_url}/v1/chat/completions", data=data,
                                 headers={"Content-Type": "application/json", "x-banyan-priority": "7",
                                          "X-Request-Id": "with-header"})
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.status == 200
    queued = [r for r in scheduler_stages(server) if r["stage"] == "queued" and r["request_id"] == "with-header"]
    assert queued and queued[0]["priority"] == 7
