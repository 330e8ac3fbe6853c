"""A clean stop looks clean: `banyan serve` stopped by Ctrl-C (SIGINT) or SIGTERM prints no
nanobind leak report (Triton's extension, torn down with the interpreter), exits 0, and takes its
ready file with it; its start-up lines agree on where SMG's service is; and it prints what the
README's quick start says it prints."""

from __future__ import annotations

import re
import signal

from tests.readme_blocks import text_blocks
from tests.support import Server
from shared.proto.banyan.v1 import generation_pb2 as pb
from shared.proto.banyan.v1 import generation_pb2_grpc as pb_grpc


def test_ctrl_c_is_quiet_and_takes_the_ready_file(demo_dir, tmp_path) -> None:
    """(SIGTERM: tests/e2e/test_readme.py's server is stopped with it and checked the same way.)"""
    server = Server(None, tmp_path / "server.log")
    ready = server.log_path.with_suffix(".ready")
    try:
        assert ready.exists()
        with server.channel() as ch:  # a request first: the worker has run its model (and its kernels' imports)
            req = pb.GenerateRequest(text="Hello", sampling_params=pb.SamplingParams(max_tokens=4))
            assert list(pb_grpc.GenerationServiceStub(ch).Generate(req, timeout=60))
        server.proc.send_signal(signal.SIGINT)
        assert server.proc.wait(60) == 0, server.log_text()[-3000:]
    finally:
        server.stop()
    text = server.log_text()
    assert "stopped" in text and '"clean": true' in text, text[-3000:]
    leaks = [line for line in text.splitlines() if "nanobind" in line or "leaked" in line]
    assert not leaks, leaks[:5]
    assert not ready.exists() and not ready.with_name(ready.name + ".tmp").exists()

    # what the README's quick start says it prints (ports aside) is what it printed
    quoted = [ln for block in text_blocks("Quick start") for ln in block.splitlines() if ln.strip()]
    assert len(quoted) >= 3
    for line in quoted:
        pattern = re.sub(r"\d+", r"\\d+", re.escape(line))
        assert re.search(f"^{pattern}$", text, re.M), f"README quotes a line serve did not print: {line!r}"

    assert "It listens on every interface" not in text  # (--host 127.0.0.1: nothing to warn about)

    records = server.log_records()
    listening = [r for r in records if r.get("event") == "tokenizer_listening"]
    serving = [r for r in records if r.get("event") == "serving"]
    assert listening and serving
    # the same port in both: SMG's service shares the gRPC port by default
    assert {r["smg_grpc_port"] for r in listening} == {serving[0]["smg_grpc_port"]} == {server.port}



def test_an_exposed_server_says_so() -> None:
    from banyan.launcher import exposure_warning

    assert "every interface" in exposure_warning("0.0.0.0", "") and "--host 127.0.0.1" in exposure_warning("::", "")
    assert exposure_warning("127.0.0.1", "") == "" and exposure_warning("0.0.0.0", "key") == ""
