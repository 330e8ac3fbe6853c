"""W3C traceparent parsing and the tracer chosen at start-up (no OpenTelemetry without an endpoint)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support import ROOT
from shared import tracing

VALID = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def test_parse_valid_and_normalized():
    assert tracing.parse(VALID) == ("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7", "01")
    assert tracing.ensure(VALID.upper()) == VALID
    assert tracing.trace_id(VALID) == "4bf92f3577b34da6a3ce929d0e0e4736"
    # a later version may carry more fields; its ids still count
    assert tracing.parse("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra")[0] == \
        "4bf92f3577b34da6a3ce929d0e0e4736"


@pytest.mark.parametrize("bad", [
    "", None, "garbage", VALID + "-x",  # version 00 has exactly four fields
    "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",  # version ff is invalid
    "00-" + "0" * 32 + "-00f067aa0ba902b7-01", "00-4bf92f3577b34da6a3ce929d0e0e4736-" + "0" * 16 + "-01",
    "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902bz-01",
])
def test_invalid_gets_a_new_trace(bad):
    assert tracing.parse(bad) is None and tracing.trace_id(bad) == ""
    made = tracing.ensure(bad)
    assert tracing.parse(made) is not None and made.endswith("-01")
    assert tracing.ensure(bad) != made  # a new trace each time


def test_trace_context():
    t = tracing.Trace.incoming(VALID)
    assert t.trace_id == "4bf92f3577b34da6a3ce929d0e0e4736" and t.start_ns > 0
    assert len(tracing.Trace.incoming(None).trace_id) == 32
    span = tracing.make_tracer("tokenizer", "").start("generate", VALID)
    assert span.traceparent == VALID  # without export a span passes its parent on
    span.end(finish_reason="stop")


def test_no_endpoint_imports_no_opentelemetry():
    code = ("import sys; from shared.tracing import make_tracer; "
            "import services.tokenizer.server, services.scheduler.scheduler, services.worker.server; "
            "make_tracer('tokenizer', '').start('generate', '').end(); "
            "bad = [m for m in sys.modules "
            "       if m.startswith(('opentelemetry.sdk', 'opentelemetry.exporter', 'shared.otel'))]; "
            "assert not bad, bad")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
