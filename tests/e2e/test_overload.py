"""Overload: past --max-queued-requests, new requests get RESOURCE_EXHAUSTED with a RetryInfo
detail (gRPC) or 429 with Retry-After (HTTP); nothing already admitted is disturbed."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2

from tests.support import Server
from shared.proto.banyan.v1 import generation_pb2 as pb
from shared.proto.banyan.v1 import generation_pb2_grpc as pb_grpc


@pytest.fixture(scope="module")
def server(demo_dir, tmp_path_factory):
    s = Server(None, tmp_path_factory.mktemp("overload") / "server.log", "--max-running-requests", "1",
               "--max-queued-requests", "2")
    yield s
    assert s.stop() == 0, s.log_text()[-3000:]


def long_call(stub, i):
    req = pb.GenerateRequest(text=f"busy {i}", sampling_params=pb.SamplingParams(max_tokens=4000, ignore_eos=True))
    return stub.Generate(req, timeout=120)


def retry_delay(err: grpc.RpcError) -> float:
    raw = dict(err.trailing_metadata())["grpc-status-details-bin"]
    info = error_details_pb2.RetryInfo()
    assert status_pb2.Status.FromString(raw).details[0].Unpack(info)
    return info.retry_delay.seconds + info.retry_delay.nanos / 1e9


def test_full_queue_is_refused_with_retry_info(server):
    """One request runs, two wait; of a burst of five more long requests the rest are refused at once."""
    with server.channel() as ch:
        stub = pb_grpc.GenerationServiceStub(ch)
        calls = [long_call(stub, 0)]  # running first (else a burst arriving before any admission
        deadline = time.monotonic() + 20  # finds it waiting too: the queue limit counts it)
        while stub.GetLoad(pb.GetLoadRequest()).num_running_requests < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        calls += [long_call(stub, i) for i in range(1, 6)]  # all sent now; each runs for seconds
        try:
            deadline = time.monotonic() + 20
            while sum(c.done() for c in calls) < 3 and time.monotonic() < deadline:
                time.sleep(0.05)
            refused = [c for c in calls if c.done()]
            assert len(refused) == 3, [c.details() for c in refused]
            for c in refused:
                assert c.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "queue is full" in c.details()
                assert retry_delay(c) >= 1
            load = stub.GetLoad(pb.GetLoadRequest())
            assert (load.num_running_requests, load.num_waiting_requests) == (1, 2)
            body = json.dumps({"model": "banyan-demo", "prompt": "one more", "max_tokens": 4}).encode()
            req = urllib.request.Request(f"{server.http_url}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            with pytest.raises(urllib.error.HTTPError) as h:
                urllib.request.urlopen(req, timeout=30)
            assert h.value.code == 429 and float(h.value.headers["Retry-After"]) >= 1
            assert "queue is full" in json.loads(h.value.read())["error"]["message"]
        finally:
            for call in calls:
                call.cancel()
        deadline = time.monotonic() + 10
        while stub.GetLoad(pb.GetLoadRequest()).num_running_requests and time.monotonic() < deadline:
            time.sleep(0.05)
        done = list(stub.Generate(pb.GenerateRequest(text="after", sampling_params=pb.SamplingParams(
            max_tokens=3, ignore_eos=True)), timeout=60))
        assert done[-1].usage.completion_tokens == 3
