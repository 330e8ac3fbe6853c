"""Several processes logging to one file (what ``banyan serve`` does with its children's stderr)
never interleave their JSON lines."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.support import ROOT

CHILD = r'''
from shared.logging import get_logger, setup_logging
setup_logging("scheduler", "info")
log = get_logger("scheduler")
for i in range(2000):
    log.info("stage", stage="queued", request_id=f"r{i}", pad="x" * 200)
'''


def test_processes_sharing_a_log_file_write_whole_lines(tmp_path) -> None:
    path = tmp_path / "shared.log"
    with open(path, "wb") as f:
        procs = [subprocess.Popen([sys.executable, "-c", CHILD], stdout=f, stderr=f, cwd=ROOT) for _ in range(3)]
        assert [p.wait(timeout=120) for p in procs] == [0, 0, 0]
    lines = path.read_text().splitlines()
    records = [json.loads(line) for line in lines]  # a merged line fails to parse
    assert len(records) == 6000 and all(r["stage"] == "queued" for r in records)
