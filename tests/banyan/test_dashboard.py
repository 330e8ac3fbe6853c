"""The Grafana dashboard only queries metrics that the services export."""

from __future__ import annotations

import json
import re

from tests.support import ROOT
from services.scheduler.metrics import SchedulerMetrics
from services.tokenizer.metrics import TokenizerMetrics
from services.worker.metrics import WorkerMetrics


def exported() -> set[str]:
    names = set()
    for m in (TokenizerMetrics(), SchedulerMetrics(), WorkerMetrics()):
        for family in m.registry.collect():
            names.update(s.name for s in family.samples)
    return names


def test_dashboard_queries_exported_metrics():
    dash = json.loads((ROOT / "deploy" / "grafana" / "banyan.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    used = {n for e in exprs for n in re.findall(r"banyan:[a-z0-9_]+", e)}
    assert used and used <= exported(), used - exported()
    titles = " ".join(p["title"].lower() for p in dash["panels"])
    for topic in ("throughput", "first token", "inter-token", "running", "kv cache", "hit rate", "retractions",
                  "finish reason"):
        assert topic in titles, topic
