"""Several processes logging to one file (what ``banyan serve`` does with its children's stderr)
never interleave their JSON lines."""

from __future__ import annotations

import json
import os
import re
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


STAGES = r'''
import sys
from shared.logging import get_logger, setup_logging, stage
setup_logging("scheduler", "info", sys.argv[1])
stage("queued", "req-1", trace_id="ab" * 16, prompt_tokens=7, n=1)
get_logger("scheduler").info("summary", running=2, queued=0, tokens_in_per_s=812.4, cache_hit_rate=None)
get_logger("scheduler").warning("worker_slow", seconds=31.5, reason="no answer yet")
'''


def _run(fmt: str, **kw) -> str:
    return subprocess.run([sys.executable, "-c", STAGES, fmt], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          check=True, **kw).stderr


def test_json_lines_keep_their_shape() -> None:
    """What the tests and log collectors parse: the keys, in this order, one object a line."""
    for fmt in ("json", "auto"):  # auto: stderr is a pipe here, so JSON
        lines = [json.loads(x) for x in _run(fmt).splitlines()]
        assert list(lines[0]) == ["stage", "request_id", "t", "trace_id", "prompt_tokens", "n", "event", "level",
                                  "timestamp", "service", "pid"]
        assert lines[0]["event"] == "stage" and lines[0]["service"] == "scheduler"
        assert [x["event"] for x in lines] == ["stage", "summary", "worker_slow"]
        assert lines[2]["level"] == "warning"


def test_text_lines_are_one_readable_line_each() -> None:
    lines = _run("text").splitlines()
    assert len(lines) == 3
    assert re.fullmatch(r"\d\d:\d\d:\d\d\.\d{3} scheduler +queued +req-1 prompt_tokens=7 n=1", lines[0]), lines[0]
    assert lines[1].endswith("summary         running=2 queued=0 tokens_in_per_s=812.4 cache_hit_rate=None"), lines[1]
    assert " WARNING worker_slow " in lines[2] and "reason='no answer yet'" in lines[2], lines[2]
    assert "trace_id" not in "".join(lines) and "{" not in "".join(lines)


def test_auto_is_text_on_a_terminal() -> None:
    import pty

    leader, follower = pty.openpty()
    try:
        subprocess.run([sys.executable, "-c", STAGES, "auto"], cwd=ROOT, stderr=follower, timeout=60, check=True)
        os.close(follower)
        out = b""
        while True:
            try:
                chunk = os.read(leader, 4096)
            except OSError:  # EIO: the terminal's other end is closed and everything was read
                break
            if not chunk:
                break
            out += chunk
    finally:
        os.close(leader)
    text = out.decode()
    assert "queued" in text and "req-1" in text and '"event"' not in text, text
