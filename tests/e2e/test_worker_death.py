"""Worker death (kill -9 mid-stream): every stream in flight (gRPC and HTTP) ends with UNAVAILABLE
within 5 s and health turns NOT_SERVING; the launcher restarts the worker, requests sent meanwhile
wait for it and complete, and the server serves again with the same greedy output as before. With
``--max-worker-restarts 0`` the launcher stops everything and exits 1 naming the dead process."""

from __future__ import annotations

import http.client
import json
import os
import signal
import threading
import time
from dataclasses import dataclass, field

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.support import Server
from shared.proto.banyan.v1 import generation_pb2 as pb
from shared.proto.banyan.v1 import generation_pb2_grpc as pb_grpc

BOUND_S = 5.0  # the bound: kill → every stream in flight ended
SERVICE = "banyan.v1.GenerationService"


@dataclass
class Stream:
    """One long generation consumed in a thread: chunks seen, how and when it ended."""

    kind: str
    chunks: int = 0
    error: str = ""  # gRPC status name, or the HTTP error event's code
    message: str = ""
    ended_at: float = 0.0
    started: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None


def long_grpc(stub, i: int) -> Stream:
    st = Stream("grpc")

    def run() -> None:
        req = pb.GenerateRequest(text=f"a long story {i}", sampling_params=pb.SamplingParams(
            max_tokens=3000, ignore_eos=True))
        try:
            for _ in stub.Generate(req, timeout=300):
                st.chunks += 1
                st.started.set()
        except grpc.RpcError as e:
            st.error, st.message = e.code().name, e.details()
        st.ended_at = time.monotonic()
        st.started.set()

    st.thread = threading.Thread(target=run, daemon=True)
    st.thread.start()
    return st


def long_http(server: Server, i: int) -> Stream:
    st = Stream("http")

    def run() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=300)
        body = json.dumps({"model": "banyan-demo", "prompt": f"a long tale {i}", "max_tokens": 3000,
                           "ignore_eos": True, "stream": True})
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200, resp.read()
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            if "error" in event:
                st.error, st.message = event["error"]["code"], event["error"]["message"]
                break
            st.chunks += 1
            st.started.set()
        st.ended_at = time.monotonic()
        st.started.set()
        conn.close()

    st.thread = threading.Thread(target=run, daemon=True)
    st.thread.start()
    return st


def health(server: Server) -> int:
    with server.channel(own_connection=True) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=10).status


def http_health(server: Server) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=10)
    conn.request("GET", "/health")
    status = conn.getresponse().status
    conn.close()
    return status


def http_completion(server: Server) -> int:
    """A small non-streamed completion's HTTP status."""
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=120)
    body = json.dumps({"model": "banyan-demo", "prompt": "sent during a restart", "max_tokens": 8, "temperature": 0})
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    status = conn.getresponse().status
    conn.close()
    return status


def started(server: Server, records: list[dict] | None = None) -> dict[str, list[int]]:
    """Process name → the pids the launcher started it as, in order."""
    out: dict[str, list[int]] = {}
    for r in records if records is not None else server.log_records():
        if r.get("event") == "started" and r.get("service") == "launcher":
            out.setdefault(r["process"], []).append(r["pid"])
    return out


def greedy(stub, text: str = "The worker dies and") -> list[int]:
    req = pb.GenerateRequest(text=text, sampling_params=pb.SamplingParams(max_tokens=24, temperature=0.0,
                                                                          ignore_eos=True))
    return [t for r in stub.Generate(req, timeout=120) for t in r.token_ids]


def open_streams(server: Server, stub, n_grpc: int = 3, n_http: int = 2) -> list[Stream]:
    streams = [long_grpc(stub, i) for i in range(n_grpc)] + [long_http(server, i) for i in range(n_http)]
    for st in streams:  # each is mid-stream: tokens are flowing
        assert st.started.wait(120) and not st.error, (st.kind, st.error, st.message)
    return streams


def kill_worker(server: Server) -> tuple[int, float]:
    pid = started(server)["worker-0"][-1]
    os.kill(pid, signal.SIGKILL)
    return pid, time.monotonic()


def assert_ended_unavailable(streams: list[Stream], killed_at: float) -> float:
    """Every stream ended with UNAVAILABLE within the bound; the slowest one's delay."""
    for st in streams:
        st.thread.join(BOUND_S + 30)  # (joined generously: the bound is asserted on the recorded time)
        assert not st.thread.is_alive(), f"{st.kind} stream still open {BOUND_S + 30:.0f} s after the kill"
        assert st.error.upper() == "UNAVAILABLE", (st.kind, st.error, st.message)
        assert "worker process exited" in st.message, st.message
        assert st.chunks > 0
    delay = max(st.ended_at for st in streams) - killed_at
    assert delay < BOUND_S, f"streams ended {delay:.2f} s after the kill"
    return delay


def wait_health(server: Server, want: int, timeout: float) -> float:
    deadline = time.monotonic() + timeout
    while (status := health(server)) != want:
        assert time.monotonic() < deadline, f"health stayed {status}, wanted {want}"
        time.sleep(0.02)
    return time.monotonic()


def test_killed_worker_fails_streams_and_is_restarted(demo_dir, tmp_path):
    server = Server(None, tmp_path / "server.log", "--max-worker-restarts", "2")
    try:
        with server.channel() as ch:
            stub = pb_grpc.GenerationServiceStub(ch)
            before = greedy(stub)
            streams = open_streams(server, stub)
            old_pid, killed_at = kill_worker(server)

            not_serving_at = wait_health(server, health_pb2.HealthCheckResponse.NOT_SERVING, 30)
            assert http_health(server) == 503
            # requests sent while the worker restarts wait for it (--restart-wait) and complete
            during_http: list[int] = []
            waiter = threading.Thread(target=lambda: during_http.append(http_completion(server)), daemon=True)
            waiter.start()
            during = greedy(stub)
            waiter.join(120)
            assert during == before and during_http == [200]
            to_unavailable = assert_ended_unavailable(streams, killed_at)

            serving_at = wait_health(server, health_pb2.HealthCheckResponse.SERVING, 180)
            assert http_health(server) == 200
            assert greedy(stub) == before  # a fresh worker, the same model: the same greedy tokens
            load = stub.GetLoad(pb.GetLoadRequest())
            assert load.num_running_requests == 0 and load.kv_free_tokens + load.kv_evictable_tokens == load.kv_pool_tokens
        pids = started(server)["worker-0"]
        assert len(pids) == 2 and pids[0] == old_pid and pids[1] != old_pid
        records = server.log_records()
        exited = [r for r in records if r.get("event") == "worker_exited"]
        assert len(exited) == 1 and exited[0]["process"] == "worker-0" and exited[0]["how"] == "killed by SIGKILL"
        lost = [r for r in records if r.get("event") == "worker_lost"]
        assert len(lost) == 1 and lost[0]["requests"] >= len(streams)
        print(f"\nkill → streams UNAVAILABLE {to_unavailable:.3f} s, → NOT_SERVING {not_serving_at - killed_at:.3f} s,"
              f" → SERVING again {serving_at - killed_at:.2f} s")
    finally:
        assert server.stop() == 0, server.log_text()[-3000:]


def test_no_restarts_left_stops_everything(demo_dir, tmp_path):
    server = Server(None, tmp_path / "server.log", "--max-worker-restarts", "0")
    try:
        with server.channel() as ch:
            stub = pb_grpc.GenerationServiceStub(ch)
            streams = open_streams(server, stub, n_grpc=2, n_http=1)
            _, killed_at = kill_worker(server)
            assert_ended_unavailable(streams, killed_at)
        assert server.proc.wait(120) == 1  # (bounded: a hang fails here)
        text, records = server.log_text(), server.log_records()
    finally:
        server.stop()
    exhausted = [r for r in records if r.get("event") == "worker_restarts_exhausted"]
    assert len(exhausted) == 1 and exhausted[0]["process"] == "worker-0"
    exited = [r for r in records if r.get("event") == "process_exited"]
    assert exited and exited[0]["process"] == "worker-0" and exited[0]["how"] == "killed by SIGKILL"
    assert "Banyan is stopping: worker-0" in text and "exited, killed by SIGKILL" in text
    children = started(server, records)
    assert len(children["worker-0"]) == 1  # not restarted
    for pids in children.values():  # every child is gone (the launcher reaped them)
        for pid in pids:
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
