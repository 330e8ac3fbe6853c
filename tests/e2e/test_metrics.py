"""Prometheus metrics of a live demo server (2 tokenizer replicas) agree with what its responses
reported: token counts, finish reasons, histogram counts; the tokenizer port sums both replicas;
the scheduler's and worker's counters agree with GetLoad."""

from __future__ import annotations

import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from tests.support import Server
from shared.proto.banyan.v1 import generation_pb2 as pb
from shared.proto.banyan.v1 import generation_pb2_grpc as pb_grpc


@pytest.fixture(scope="module")
def server(demo_dir, tmp_path_factory):
    s = Server(None, tmp_path_factory.mktemp("metrics") / "server.log", "--num-tokenizers", "2")
    yield s
    assert s.stop() == 0, s.log_text()[-3000:]


def scrape(server, service="tokenizer") -> dict[tuple, float]:
    """{(sample name, sorted labels): value}."""
    out = {}
    for family in text_string_to_metric_families(server.metrics(service)):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(m: dict, name: str, **labels) -> float:
    return m.get((name, tuple(sorted((k, str(v)) for k, v in labels.items()))), 0.0)


def delta(after: dict, before: dict, name: str, **labels) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


def wait_idle(stub, timeout=10.0) -> pb.GetLoadResponse:
    deadline = time.monotonic() + timeout
    while True:
        load = stub.GetLoad(pb.GetLoadRequest())
        if (load.num_running_requests == 0 and load.num_waiting_requests == 0) or time.monotonic() > deadline:
            return load
        time.sleep(0.05)


class Ledger:
    """What the responses said: usage sums, finish reasons per branch, token-carrying outputs."""

    def __init__(self) -> None:
        self.requests = 0
        self.prompt = self.completion = self.cached = 0
        self.reasons: dict[str, int] = {}
        self.gaps = 0  # inter-token latencies: one per token of a branch after its first
        self.lock = threading.Lock()

    def add(self, prompt: int, completion: int, cached: int, reasons: list[str], completions: list[int]) -> None:
        with self.lock:
            self._add(prompt, completion, cached, reasons, completions)

    def _add(self, prompt: int, completion: int, cached: int, reasons: list[str], completions: list[int]) -> None:
        self.requests += 1
        self.prompt += prompt
        self.completion += completion
        self.cached += cached
        for r in reasons:
            self.reasons[r] = self.reasons.get(r, 0) + 1
        self.gaps += sum(max(0, c - 1) for c in completions)


GRPC_REASON = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_ABORT: "abort"}


def grpc_gen(server, ledger: Ledger, text: str, rid: str = "", **sp) -> list[int]:
    with server.channel(own_connection=True) as ch:  # a new connection: the kernel picks a replica
        resps = list(pb_grpc.GenerationServiceStub(ch).Generate(
            pb.GenerateRequest(text=text, request_id=rid, sampling_params=pb.SamplingParams(**sp)), timeout=60))
    u = resps[-1].usage
    ledger.add(u.prompt_tokens, u.completion_tokens, u.cached_tokens, [GRPC_REASON[resps[-1].finish_reason]],
               [u.completion_tokens])
    return [t for r in resps for t in r.token_ids]


def test_tokenizer_metrics_match_responses_across_replicas(server, stub):
    before = scrape(server)
    ledger = Ledger()
    rids = []

    def one(i: int) -> None:
        rid = f"metrics-{i}-{uuid.uuid4().hex[:6]}"
        rids.append(rid)
        grpc_gen(server, ledger, f"metrics story number {i}", rid, max_tokens=3 + i % 5, ignore_eos=True,
                 temperature=0.0)

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(one, range(12)))
    # both replicas served some (each request came on its own connection); more until they have
    for i in range(12, 40):
        pids = {r["pid"] for r in server.log_records() if r.get("stage") == "received" and r.get("request_id") in rids}
        if len(pids) == 2:
            break
        one(i)
    assert len(pids) == 2, "both tokenizer replicas must have served requests"
    # the same prompt twice: the second reuses the first's KV (cached tokens in its usage)
    for _ in range(2):
        grpc_gen(server, ledger, "a prompt that is sent twice to hit the cache", max_tokens=4, ignore_eos=True)
    # a stop token id: finish_reason stop
    toks = grpc_gen(server, ledger, "stop me", max_tokens=12, ignore_eos=True, temperature=0.0)
    grpc_gen(server, ledger, "stop me", max_tokens=12, ignore_eos=True, temperature=0.0, stop_token_ids=[toks[3]])
    # aborted on the server: finish_reason abort
    call = stub.Generate(pb.GenerateRequest(text="abort me", request_id=f"abort-{uuid.uuid4().hex[:6]}",
                                            sampling_params=pb.SamplingParams(max_tokens=3000, ignore_eos=True)),
                         timeout=60)
    first = next(call)
    assert stub.Abort(pb.AbortRequest(request_id=first.request_id)).found
    resps = [first, *call]
    u = resps[-1].usage
    assert resps[-1].finish_reason == pb.FINISH_REASON_ABORT
    ledger.add(u.prompt_tokens, u.completion_tokens, u.cached_tokens, ["abort"], [u.completion_tokens])
    # HTTP, n = 2: usage counts the prompt once; two branches end
    r = requests.post(f"{server.http_url}/v1/completions", json={
        "prompt": "two branches of one prompt", "max_tokens": 5, "n": 2, "ignore_eos": True}, timeout=60).json()
    ledger.add(r["usage"]["prompt_tokens"], r["usage"]["completion_tokens"],
               r["usage"]["prompt_tokens_details"]["cached_tokens"], [c["finish_reason"] for c in r["choices"]],
               [5, 5])

    after = scrape(server)
    assert delta(after, before, "banyan:prompt_tokens_total") == ledger.prompt
    assert delta(after, before, "banyan:generation_tokens_total") == ledger.completion
    assert delta(after, before, "banyan:cached_tokens_total") == ledger.cached > 0
    for reason in ("stop", "length", "abort", "error"):
        assert delta(after, before, "banyan:request_success_total", finish_reason=reason) == \
            ledger.reasons.get(reason, 0), reason
    assert delta(after, before, "banyan:time_to_first_token_seconds_count") == ledger.requests
    assert delta(after, before, "banyan:e2e_request_latency_seconds_count") == ledger.requests
    assert delta(after, before, "banyan:inter_token_latency_seconds_count") == ledger.gaps
    assert delta(after, before, "banyan:e2e_request_latency_seconds_sum") > 0
    inf = value(after, "banyan:time_to_first_token_seconds_bucket", le="+Inf")
    assert inf == value(after, "banyan:time_to_first_token_seconds_count")
    # every scrape (new connections land on either replica) reads the same shared totals
    for _ in range(4):
        again = scrape(server)
        assert value(again, "banyan:generation_tokens_total") == value(after, "banyan:generation_tokens_total")
    # the replicas' GC pauses, observed from their loops once a second (multiprocess mode: no custom collector)
    for _ in range(50):
        young = value(scrape(server), "banyan:gc_pause_seconds_count", generation=0)
        if young > 0:
            break
        time.sleep(0.1)
    assert young > 0
    # the replicas' loop lag, observed at every wake-up of a 20-ms timer: many by now
    lag = scrape(server)
    count = value(lag, "banyan:event_loop_lag_seconds_count")
    assert count > 10
    assert value(lag, "banyan:event_loop_lag_seconds_bucket", le="+Inf") == count


def test_scheduler_and_worker_metrics(server, stub):
    wait_idle(stub)
    s0, w0, l0 = scrape(server, "scheduler"), scrape(server, "worker"), stub.GetLoad(pb.GetLoadRequest())
    ledger = Ledger()
    for i in range(3):
        grpc_gen(server, ledger, f"scheduler metrics {i}", max_tokens=4, ignore_eos=True)
    with server.channel() as ch:  # n = 3: three branches queue
        list(pb_grpc.GenerationServiceStub(ch).Generate(pb.GenerateRequest(
            text="three branches", sampling_params=pb.SamplingParams(max_tokens=3, n=3, ignore_eos=True)), timeout=60))
        list(pb_grpc.GenerationServiceStub(ch).Generate(pb.GenerateRequest(
            text="digits", regex=r"[0-9]{3}", sampling_params=pb.SamplingParams(max_tokens=8)), timeout=60))
    # while a long request runs, it holds KV and is counted as running
    call = stub.Generate(pb.GenerateRequest(text="hold some KV", request_id=f"hold-{uuid.uuid4().hex[:6]}",
                                            sampling_params=pb.SamplingParams(max_tokens=3000, ignore_eos=True)),
                         timeout=60)
    first = next(call)
    busy = scrape(server, "scheduler")
    stub.Abort(pb.AbortRequest(request_id=first.request_id))
    list(call)
    assert value(busy, "banyan:num_running_requests") >= 1
    assert 0 < value(busy, "banyan:kv_cache_usage") <= 1

    l1 = wait_idle(stub)
    time.sleep(0.3)  # the idle loop refreshes the gauges
    s1, w1 = scrape(server, "scheduler"), scrape(server, "worker")
    assert delta(s1, s0, "banyan:queue_time_seconds_count") == 3 + 3 + 1 + 1  # branches first scheduled
    assert delta(s1, s0, "banyan:grammar_compile_seconds_count") == 1
    assert value(s1, "banyan:num_running_requests") == value(s1, "banyan:num_waiting_requests") == 0
    assert value(s1, "banyan:kv_cache_usage") == 0  # idle: what is cached is evictable, not in use
    assert value(s1, "banyan:kv_cache_evictable_tokens") == l1.kv_evictable_tokens > 0
    assert 0 < value(s1, "banyan:cache_hit_rate") < 1  # the n = 3 branches share one prefill
    assert value(s1, "banyan:retractions_total") == l1.retractions
    steps = l1.steps - l0.steps
    tokens = (l1.prefill_computed_tokens + l1.decode_tokens) - (l0.prefill_computed_tokens + l0.decode_tokens)
    assert delta(w1, w0, "banyan:forward_time_seconds_count") == steps > 0
    assert delta(w1, w0, "banyan:forward_tokens_total") == tokens
    kinds = ("decode_graph", "decode_eager", "mixed", "prefill", "decode_piecewise", "mixed_piecewise",
             "prefill_piecewise")  # every step has one kind
    assert sum(delta(w1, w0, "banyan:step_device_seconds_count", kind=k) for k in kinds) == steps
    assert sum(delta(w1, w0, "banyan:step_tokens_total", kind=k) for k in kinds) == tokens
    assert delta(w1, w0, "banyan:step_device_seconds_count", kind="prefill") > 0  # (CPU: no graphs)
    assert delta(w1, w0, "banyan:step_device_seconds_count", kind="decode_eager") > 0
    assert value(w1, "banyan:forward_failures_total") == 0


def test_stage_lines_share_a_generated_trace_id(server, stub):
    rid = f"trace-{uuid.uuid4().hex[:8]}"
    list(stub.Generate(pb.GenerateRequest(text="trace me", request_id=rid,
                                          sampling_params=pb.SamplingParams(max_tokens=3)), timeout=60))
    recs = [r for r in server.log_records() if r.get("request_id") == rid and r.get("event") == "stage"]
    assert {"tokenizer", "scheduler", "worker"} <= {r["service"] for r in recs}
    ids = {r.get("trace_id") for r in recs}
    assert len(ids) == 1 and len(ids.pop() or "") == 32
