"""Faults in the services of one live server (``--num-tokenizers 2``), in order: the scheduler
killed under load (its streams end UNAVAILABLE within 1 s, a new request waits for the restarted
group, which serves the same greedy tokens), one tokenizer replica killed (no request on the
other fails, the replica comes back on the shared port), served-model aliases, and last a worker
that keeps dying at start (a crash loop: the launcher exits 1 within 60 s naming it, and leaves no
process or run directory behind). Each prints its figures (recovery time, requests lost)."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2

from tests.e2e.test_worker_death import greedy, health, open_streams, started
from tests.support import Server
from shared.proto.banyan.v1 import generation_pb2 as pb
from shared.proto.banyan.v1 import generation_pb2_grpc as pb_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING
ALIASES = ("banyan-demo", "demo-alias")
TOKENS = 400  # per stream of the tokenizer test


@pytest.fixture(scope="module")
def run_root(tmp_path_factory) -> Path:
    """The server's temp dir (TMPDIR): its run directory lives here, and nothing else."""
    return tmp_path_factory.mktemp("t")


@pytest.fixture(scope="module")
def model_dir(demo_dir, tmp_path_factory) -> Path:
    """A copy of the demo model: the crash-loop test breaks it."""
    d = tmp_path_factory.mktemp("m") / "model"
    shutil.copytree(demo_dir, d)
    return d


@pytest.fixture(scope="module")
def server(model_dir, run_root, tmp_path_factory):
    s = Server(str(model_dir), tmp_path_factory.mktemp("log") / "server.log", "--num-tokenizers", "2",
               "--max-restarts", "2", "--restart-wait", "150",
               *(x for a in ALIASES for x in ("--served-model-name", a)), env={"TMPDIR": str(run_root)})
    yield s
    s.stop()


def records(server: Server, event: str) -> list[dict]:
    return [r for r in server.log_records() if r.get("event") == event]


def wait_for(cond, what: str, timeout: float = 180.0):
    deadline = time.monotonic() + timeout
    while not (value := cond()):
        assert time.monotonic() < deadline, f"never happened within {timeout:.0f} s: {what}"
        time.sleep(0.05)
    return value


def restarts(server: Server, service: str) -> float:
    line = next(x for x in server.metrics().splitlines()
                if x.startswith(f'banyan:service_restarts_total{{service="{service}"}}'))
    return float(line.split()[-1])


def test_killed_scheduler_ends_its_streams_and_its_group_comes_back(server, stub):
    before = greedy(stub)
    streams = open_streams(server, stub, n_grpc=6, n_http=2)
    old = started(server)
    os.kill(old["scheduler"][-1], signal.SIGKILL)
    killed_at = time.monotonic()
    for st in streams:
        st.thread.join(30)
        assert not st.thread.is_alive(), f"{st.kind} stream still open 30 s after the kill"
        assert st.error.upper() == "UNAVAILABLE" and "scheduler exited" in st.message, (st.kind, st.error, st.message)
    slowest = max(st.ended_at for st in streams) - killed_at
    assert slowest < 1.0, f"streams ended {slowest:.3f} s after the kill"
    waited = greedy(stub)  # a new request (the loss noticed) waits for the restarted group (--restart-wait)
    served_at = time.monotonic()
    assert waited == before  # the same model in a fresh group: the same greedy tokens
    assert health(server) == SERVING and greedy(stub) == before
    now = started(server)
    assert len(now["scheduler"]) == len(old["scheduler"]) + 1 and len(now["worker-0"]) == len(old["worker-0"]) + 1
    exited = records(server, "scheduler_exited")
    assert len(exited) == 1 and exited[0]["how"] == "killed by SIGKILL"
    assert exited[0]["restarting"] == ["scheduler", "worker-0"]  # the whole group
    assert restarts(server, "scheduler") == 1.0 and restarts(server, "tokenizer-0") == 0.0
    print(f"\nscheduler kill -9: {len(streams)} streams in flight ended UNAVAILABLE within {slowest:.3f} s; "
          f"a new request waited and was served {served_at - killed_at:.2f} s after the kill (group back)")


def one_stream(server: Server, rid: str, out: dict, ended: dict, started_ev: threading.Event) -> threading.Thread:
    """A greedy stream of ``TOKENS`` tokens on a connection of its own: its token count, or its error, in ``out``."""

    def run() -> None:
        with server.channel(own_connection=True) as ch:
            req = pb.GenerateRequest(text=f"replica {rid}", request_id=rid, sampling_params=pb.SamplingParams(
                max_tokens=TOKENS, temperature=0.0, ignore_eos=True))
            n = 0
            try:
                for r in pb_grpc.GenerationServiceStub(ch).Generate(req, timeout=300):
                    n += len(r.token_ids)
                    started_ev.set()
                out[rid] = n
            except grpc.RpcError as e:
                out[rid] = e.code().name
            ended[rid] = time.monotonic()
            started_ev.set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_killed_tokenizer_replica_loses_only_its_own_requests_and_comes_back(server):
    def replica_of() -> dict[str, int]:  # request id → the pid of the replica that received it
        return {r["request_id"]: r["pid"] for r in server.log_records()
                if r.get("stage") == "received" and r["request_id"].startswith("tk-")}

    pids = {started(server)[f"tokenizer-{i}"][-1] for i in range(2)}
    out: dict[str, object] = {}
    ended: dict[str, float] = {}
    threads, evs = [], []
    for i in range(40):  # until both replicas hold streams (the kernel spreads connections over them)
        ev = threading.Event()
        threads.append(one_stream(server, f"tk-{i}", out, ended, ev))
        evs.append(ev)
        assert ev.wait(120)
        if i >= 5 and set(replica_of().values()) == pids:
            break
    where = replica_of()
    assert set(where.values()) == pids, "every stream landed on one replica"
    victim = started(server)["tokenizer-1"][-1]
    os.kill(victim, signal.SIGKILL)
    killed_at = time.monotonic()
    # (a connection made while it dies can still land in its listening socket's queue, and is reset:
    # it is one of the killed process's own)
    wait_for(lambda: [r for r in records(server, "tokenizer_exited") if r["pid"] == victim], "the replica reaped", 60)
    fresh = []
    for i in range(4):  # new connections meanwhile: served by the other replica
        with server.channel(own_connection=True) as ch:
            fresh.append(greedy(pb_grpc.GenerationServiceStub(ch), f"during {i}"))
    for t in threads:
        t.join(180)
        assert not t.is_alive()
    lost = [rid for rid, pid in where.items() if pid == victim and ended[rid] > killed_at]  # in flight on it
    for rid, pid in where.items():
        if rid in lost:  # (gRPC's status for a connection that broke mid-call)
            assert out[rid] == "UNAVAILABLE", (rid, out[rid])
        else:
            assert out[rid] == TOKENS, (rid, out[rid])  # no request on the other replica failed
    assert all(len(f) == 24 for f in fresh)
    back = wait_for(lambda: records(server, "tokenizer_serving_again"), "tokenizer-1 serving again")
    assert back[0]["process"] == "tokenizer-1" and back[0]["pid"] not in pids
    assert restarts(server, "tokenizer-1") == 1.0
    assert len(started(server)["tokenizer-1"]) == 2
    print(f"\ntokenizer kill -9: {len(where)} streams, {len(lost)} on the killed replica lost, "
          f"{len(where) - len(lost)} on the other completed; back {back[0]['down_s']:.2f} s after its exit")


def test_served_model_aliases(server):
    with server.channel(own_connection=True) as ch:
        assert pb_grpc.GenerationServiceStub(ch).GetModelInfo(pb.GetModelInfoRequest()).model == ALIASES[0]

    def post(model: str) -> tuple[int, dict]:
        conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=60)
        conn.request("POST", "/v1/completions", json.dumps({"model": model, "prompt": "hi", "max_tokens": 2}),
                     {"Content-Type": "application/json"})
        r = conn.getresponse()
        body = json.loads(r.read())
        conn.close()
        return r.status, body

    with urllib.request.urlopen(f"{server.http_url}/v1/models", timeout=30) as r:
        assert [m["id"] for m in json.loads(r.read())["data"]] == [ALIASES[0]]
    for name in ALIASES:
        status, body = post(name)
        assert status == 200 and body["model"] == ALIASES[0], body
    status, body = post("model")  # the directory's name is not a name any more: the aliases replace it
    assert status == 404 and body["error"]["param"] == "model"


def test_crash_loop_stops_the_server_and_leaves_nothing(server, model_dir, run_root):
    (model_dir / "config.json").unlink()  # every worker started from now on dies at start
    pids = [p for ps in started(server).values() for p in ps]
    os.kill(started(server)["worker-0"][-1], signal.SIGKILL)
    killed_at = time.monotonic()
    assert server.proc.wait(90) == 1
    took = time.monotonic() - killed_at
    assert took < 60, f"the launcher stopped {took:.1f} s after the crash loop began"
    text = server.log_text()
    stops = [x for x in text.splitlines() if x.startswith("Banyan is stopping:")]
    assert len(stops) == 1 and stops[0].startswith("Banyan is stopping: worker-0 "), stops
    assert "a crash loop" in stops[0], stops
    assert "no config.json" in text  # the worker's own one line says why it dies
    assert len(records(server, "worker_exited")) == 2 and len(records(server, "worker_restarts_exhausted")) == 1
    for pid in pids + [p for ps in started(server).values() for p in ps]:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert not list(run_root.glob("banyan-*")), list(run_root.iterdir())  # no run directory left
    print(f"\ncrash loop: the launcher exited 1 {took:.1f} s after the first kill ({stops[0]})")
