"""--otlp-endpoint with no collector: the exporter's retries stay bounded and the failure is said
once (``otlp_export_failed``), not a line per retry of every batch."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from tests.support import ROOT

pytest.importorskip("opentelemetry.exporter.otlp.proto.grpc.trace_exporter",
                    reason="the otel extra (OTLP exporter) is not installed")

SCRIPT = """
import sys
from shared.logging import setup_logging
from shared.otel import OtelTracer
setup_logging("tokenizer", "info", "json")
t = OtelTracer("tokenizer", sys.argv[1])
for batch in range(3):  # three batches, each exported (and failing) on its own
    for i in range(4):
        t.start("generate", "", request_id=f"r{batch}-{i}").end()
    assert t.provider.force_flush(30_000) in (True, False)
t.shutdown()
"""


def test_no_collector_is_said_once(tmp_path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OTEL_EXPORTER_OTLP_TIMEOUT": "2"}
    r = subprocess.run([sys.executable, "-c", SCRIPT, f"127.0.0.1:{port}"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()]
    events = [json.loads(ln).get("event") for ln in lines if ln.startswith("{")]
    assert events.count("otlp_export_failed") == 1, lines
    assert not [ln for ln in lines if "retrying" in ln or "Failed to export" in ln or "Transient error" in ln], lines
