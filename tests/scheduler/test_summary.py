"""The scheduler's periodic summary line (services/scheduler/summary.py), driven by a fake clock."""

from __future__ import annotations

import pytest

from services.scheduler.summary import Summary


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class Log:
    def __init__(self) -> None:
        self.lines: list[tuple[str, dict]] = []

    def info(self, event: str, **kw) -> None:
        self.lines.append((event, kw))


@pytest.fixture
def summary():
    clock, logs = Clock(), Log()
    return Summary(10.0, clock=clock, logger=logs), clock, logs


def test_one_line_per_interval_with_the_rates_over_it(summary) -> None:
    s, clock, logs = summary
    assert not s.tick(running=0, waiting=0, prompt_tokens=0, cached_tokens=0, generated_tokens=0, kv_used=0,
                      kv_pool=1000)
    for _ in range(9):  # many loop iterations inside one interval: no line
        clock.t += 1.0
        assert not s.tick(2, 1, 500, 100, 40, 250, 1000)
    clock.t += 1.5  # 10.5 s after the first tick
    assert s.tick(running=4, waiting=3, prompt_tokens=1050, cached_tokens=420, generated_tokens=210, kv_used=250,
                  kv_pool=1000)
    assert logs.lines == [("summary", {"running": 4, "queued": 3, "tokens_in_per_s": 100.0, "tokens_out_per_s": 20.0,
                                       "cache_hit_rate": 0.4, "kv_usage": 0.25, "interval_s": 10.5})]
    clock.t += 5  # the next interval counts from the last line
    assert not s.tick(4, 3, 1100, 420, 260, 250, 1000)
    clock.t += 5
    assert s.tick(4, 0, 1250, 420, 310, 100, 1000)
    assert logs.lines[-1][1] == {"running": 4, "queued": 0, "tokens_in_per_s": 20.0, "tokens_out_per_s": 10.0,
                                  "cache_hit_rate": 0.0, "kv_usage": 0.1, "interval_s": 10.0}


def test_idle_server_logs_once_then_stays_quiet_until_work_returns(summary) -> None:
    s, clock, logs = summary
    s.tick(1, 0, 0, 0, 0, 10, 100)
    clock.t += 10
    assert s.tick(1, 0, 100, 0, 50, 10, 100)  # busy
    for _ in range(3):  # idle: one line saying so, then silence
        clock.t += 10
        s.tick(0, 0, 100, 0, 50, 0, 100)
    assert [kw["running"] for _, kw in logs.lines] == [1, 0]
    assert logs.lines[-1][1]["tokens_in_per_s"] == 0 and logs.lines[-1][1]["cache_hit_rate"] is None
    clock.t += 10
    assert s.tick(0, 2, 100, 0, 50, 0, 100)  # queued work is activity again
    assert logs.lines[-1][1]["queued"] == 2


def test_counters_that_restart_count_from_zero_and_interval_zero_is_off(summary) -> None:
    s, clock, logs = summary
    s.tick(1, 0, 5000, 100, 800, 10, 100)
    clock.t += 10
    assert s.tick(1, 0, 300, 0, 20, 10, 100)  # the scheduler reset its counters (a lost worker)
    assert logs.lines[-1][1]["tokens_in_per_s"] == 30.0 and logs.lines[-1][1]["tokens_out_per_s"] == 2.0
    off = Summary(0, clock=clock, logger=logs)
    for _ in range(3):
        clock.t += 100
        assert not off.tick(5, 5, 10, 0, 10, 1, 2)
    assert len(logs.lines) == 1


def test_default_logger_writes_a_summary_line(capfd) -> None:
    from shared.logging import setup_logging

    setup_logging("scheduler", "info", "json")
    clock = Clock()
    s = Summary(1.0, clock=clock)
    s.tick(1, 0, 0, 0, 0, 1, 10)
    clock.t += 2
    s.tick(1, 0, 10, 5, 4, 1, 10)
    import json

    line = json.loads(capfd.readouterr().err.strip().splitlines()[-1])
    assert (line["event"], line["service"], line["running"], line["cache_hit_rate"]) == ("summary", "scheduler", 1, 0.5)
