"""The scheduler's and worker's /metrics endpoint keeps the classic text format and the
``banyan:`` names whatever the scraper asks for (an OpenMetrics scrape would rename them)."""

from __future__ import annotations

import urllib.request

import pytest
from tests.support import free_port

from services.scheduler.metrics import SchedulerMetrics
from services.worker.metrics import WorkerMetrics


@pytest.mark.parametrize("cls", [WorkerMetrics, SchedulerMetrics])
@pytest.mark.parametrize("accept", ["application/openmetrics-text; version=1.0.0", "text/plain", "*/*"])
def test_metrics_are_plain_text_with_colon_names(cls, accept) -> None:
    port = free_port()
    m = cls()
    m.serve(port)
    try:
        req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers={"Accept": accept})
        with urllib.request.urlopen(req, timeout=10) as r:
            assert r.headers["Content-Type"].startswith("text/plain")
            text = r.read().decode()
        names = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")}
        assert names and all(n.startswith("banyan:") for n in names), names
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/nope", timeout=10)
    finally:
        m.close()
