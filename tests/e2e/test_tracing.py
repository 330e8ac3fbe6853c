"""W3C trace context through all three processes: a request's stage lines share its trace id (the
client's, or one made at ``received``), and with ``--otlp-endpoint`` each service exports one span
per request, parented tokenizer → scheduler → worker, to an in-test OTLP/gRPC collector."""

from __future__ import annotations

import importlib.util
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import requests

from tests.support import Server
from shared.proto.banyan.v1 import generation_pb2 as pb

OTEL = importlib.util.find_spec("opentelemetry.sdk") is not None and \
    importlib.util.find_spec("opentelemetry.exporter.otlp.proto.grpc") is not None
SERVICES = {"tokenizer", "scheduler", "worker"}


class Collector:
    """An OTLP/gRPC trace receiver: (service.name, span) of everything exported to it."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

        collector = self

        class Service(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):
                with collector.lock:
                    for rs in request.resource_spans:
                        attrs = {a.key: a.value.string_value for a in rs.resource.attributes}
                        name = attrs.get("service.name", "")
                        for ss in rs.scope_spans:
                            collector.spans.extend((name, sp) for sp in ss.spans)
                return trace_service_pb2.ExportTraceServiceResponse()

        self.lock = threading.Lock()
        self.spans: list = []
        self.server = grpc.server(ThreadPoolExecutor(4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def of_trace(self, trace_id: str) -> dict[str, list]:
        with self.lock:
            out: dict[str, list] = {}
            for name, sp in self.spans:
                if sp.trace_id.hex() == trace_id:
                    out.setdefault(name, []).append(sp)
            return out


@pytest.fixture(scope="module")
def collector():
    if not OTEL:
        yield None
        return
    c = Collector()
    yield c
    c.server.stop(0)


@pytest.fixture(scope="module")
def server(demo_dir, tmp_path_factory, collector):
    args = ["--otlp-endpoint", f"127.0.0.1:{collector.port}"] if collector else []
    s = Server(None, tmp_path_factory.mktemp("tracing") / "server.log", *args,
               env={"OTEL_BSP_SCHEDULE_DELAY": "100"})
    yield s
    assert s.stop() == 0, s.log_text()[-3000:]


def stage_lines(server, rid: str, timeout: float = 5.0) -> list[dict]:
    """The request's stage lines once every service has logged (the worker's release comes with a later batch)."""
    deadline = time.monotonic() + timeout
    while True:
        recs = [r for r in server.log_records() if r.get("request_id") == rid and r.get("event") == "stage"]
        if SERVICES <= {r["service"] for r in recs} or time.monotonic() > deadline:
            return recs
        time.sleep(0.05)


def new_ids() -> tuple[str, str]:
    return uuid.uuid4().hex, uuid.uuid4().hex[:16]


def test_grpc_traceparent_in_every_stage_line(server, stub):
    trace_id, parent = new_ids()
    rid = f"traced-{trace_id[:8]}"
    list(stub.Generate(pb.GenerateRequest(text="follow my trace", request_id=rid,
                                          sampling_params=pb.SamplingParams(max_tokens=4, ignore_eos=True)),
                       metadata=[("traceparent", f"00-{trace_id}-{parent}-01")], timeout=60))
    recs = stage_lines(server, rid)
    assert SERVICES <= {r["service"] for r in recs}, recs
    assert {r.get("trace_id") for r in recs} == {trace_id}, recs
    stages = {r["stage"] for r in recs}
    assert {"received", "tokenized", "queued", "scheduled", "worker_admitted", "first_token", "finished",
            "sent"} <= stages


def test_http_traceparent_in_every_stage_line(server):
    trace_id, parent = new_ids()
    rid = f"traced-http-{trace_id[:8]}"
    r = requests.post(f"{server.http_url}/v1/completions", json={"prompt": "follow me over HTTP", "max_tokens": 3},
                      headers={"traceparent": f"00-{trace_id}-{parent}-01", "X-Request-Id": rid}, timeout=60)
    assert r.status_code == 200
    recs = stage_lines(server, rid)
    assert SERVICES <= {r["service"] for r in recs}, recs
    assert {r.get("trace_id") for r in recs} == {trace_id}


@pytest.mark.parametrize("traceparent", [None, "not-a-traceparent", "00-" + "0" * 32 + "-00f067aa0ba902b7-01"])
def test_missing_or_invalid_traceparent_gets_a_new_trace(server, stub, traceparent):
    rid = f"untraced-{uuid.uuid4().hex[:8]}"
    metadata = [("traceparent", traceparent)] if traceparent else []
    list(stub.Generate(pb.GenerateRequest(text="no trace given", request_id=rid,
                                          sampling_params=pb.SamplingParams(max_tokens=3)),
                       metadata=metadata, timeout=60))
    recs = stage_lines(server, rid)
    assert SERVICES <= {r["service"] for r in recs}, recs
    ids = {r.get("trace_id") for r in recs}
    assert len(ids) == 1
    made = ids.pop()
    assert made and len(made) == 32 and made != "0" * 32 and int(made, 16)


@pytest.mark.skipif(not OTEL, reason="the otel extra (opentelemetry-sdk, OTLP exporter) is not installed")
def test_spans_exported_tokenizer_to_scheduler_to_worker(server, stub, collector):
    trace_id, parent = new_ids()
    list(stub.Generate(pb.GenerateRequest(text="export my spans", sampling_params=pb.SamplingParams(
        max_tokens=4, ignore_eos=True)), metadata=[("traceparent", f"00-{trace_id}-{parent}-01")], timeout=60))
    # the worker's span ends when its row is released, which rides on the next batch
    list(stub.Generate(pb.GenerateRequest(text="next", sampling_params=pb.SamplingParams(max_tokens=2)), timeout=60))
    deadline = time.monotonic() + 15
    while len(spans := collector.of_trace(trace_id)) < 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert set(spans) == {"banyan-tokenizer", "banyan-scheduler", "banyan-worker"}, spans
    (gen,), (sched,), (fwd,) = spans["banyan-tokenizer"], spans["banyan-scheduler"], spans["banyan-worker"]
    assert (gen.name, sched.name, fwd.name) == ("generate", "schedule", "forward")
    assert gen.parent_span_id.hex() == parent
    assert sched.parent_span_id == gen.span_id and fwd.parent_span_id == sched.span_id
    assert gen.start_time_unix_nano <= sched.start_time_unix_nano <= fwd.start_time_unix_nano
    assert sched.end_time_unix_nano <= gen.end_time_unix_nano
    attrs = {a.key: a.value for a in gen.attributes}
    assert attrs["completion_tokens"].int_value == 4 and attrs["finish_reason"].string_value == "length"
