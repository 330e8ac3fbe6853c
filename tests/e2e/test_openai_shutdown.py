"""``banyan serve`` on SIGTERM: open OpenAI-API streams end well-formed (a server of its own; the
rest of the HTTP API is tested in ``test_openai.py``)."""

from __future__ import annotations

import json

from tests.e2e.test_openai import _open_stream
from tests.support import Server


def test_sigterm_ends_open_streams_well_formed(demo_dir, tmp_path):
    """On SIGTERM a replica stops accepting, lets streams run for the grace period, then ends them
    with finish_reason "abort" and [DONE] (not a cut connection), and exits 0."""
    s = Server(None, tmp_path / "server.log", "--grace-seconds", "1")
    try:
        conn = _open_stream(s, "shutdown-1", True, key=None)
        resp = conn.getresponse()
        assert resp.status == 200 and resp.readline().startswith(b"data: {")
        s.proc.terminate()
        events = [line for line in iter(resp.readline, b"") if line.strip()]
        assert events[-1] == b"data: [DONE]\n"
        assert json.loads(events[-2][len(b"data: "):])["choices"][0]["finish_reason"] == "abort"
        conn.close()
    finally:
        assert s.stop() == 0, s.log_text()[-3000:]
