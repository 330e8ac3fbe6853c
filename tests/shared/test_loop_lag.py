"""The event-loop lag watch (``shared/loop_lag.py``): a loop blocked for 30 ms wakes the watch
at least 20 ms late (it asked for every 10 ms), that shows in what it observes and in the window's
``event_loop_lag`` log line; a quiet window writes none."""

from __future__ import annotations

import asyncio
import time

from shared import loop_lag


class _Log:
    def __init__(self) -> None:
        self.lines: list[tuple[str, dict]] = []

    def info(self, event: str, **kw) -> None:
        self.lines.append((event, kw))


def test_a_blocked_loop_is_seen_late(monkeypatch) -> None:
    log = _Log()
    monkeypatch.setattr(loop_lag, "log", log)
    seen: list[float] = []

    async def main() -> None:
        watch = asyncio.create_task(loop_lag.watch_lag(seen.append, interval=0.01, report_every=0.2))
        await asyncio.sleep(0.05)
        time.sleep(0.03)  # a handler that holds the loop
        await asyncio.sleep(0.3)
        watch.cancel()

    asyncio.run(main())
    assert len(seen) >= 5 and max(seen) >= 0.02
    (event, kw), *_ = log.lines
    assert event == "event_loop_lag" and kw["max_ms"] >= 20 and kw["wakeups"] >= 2
    assert kw["p50_ms"] <= kw["p99_ms"] <= kw["max_ms"]


def test_summary_and_a_quiet_window(monkeypatch) -> None:
    assert loop_lag.summary([0.001, 0.002, 0.05]) == {"wakeups": 3, "p50_ms": 2.0, "p99_ms": 50.0, "max_ms": 50.0}
    log = _Log()
    monkeypatch.setattr(loop_lag, "log", log)
    monkeypatch.setattr(loop_lag, "REPORT_OVER_S", 10.0)  # (no wake-up is that late: nothing to report)

    async def main() -> None:
        watch = asyncio.create_task(loop_lag.watch_lag(lambda _: None, interval=0.01, report_every=0.05))
        await asyncio.sleep(0.2)
        watch.cancel()

    asyncio.run(main())
    assert log.lines == []
