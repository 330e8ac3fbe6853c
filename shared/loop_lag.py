"""How late an asyncio loop runs what is ready: a task asks to wake every ``interval`` seconds and
observes how much later than asked it woke. Under a loop that is busy (a tokenizer detokenizing
and writing ~10k streamed tokens a second, a GC pause, a slow handler) every new request's
``received`` stage, and every token on its way out, waits that long too — a delay the stage lines
cannot show, since they are written by the same loop. Observed into ``banyan:event_loop_lag_seconds``
and, every ``report_every`` seconds in which some wake-up was over ``REPORT_OVER_S`` late, summed up
in an ``event_loop_lag`` log line (wake-ups, p50 / p99 / max ms): visible without a metrics scrape."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from shared.logging import get_logger

LAG_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
REPORT_OVER_S = 0.005
log = get_logger("loop")


async def watch_lag(observe: Callable[[float], None], interval: float = 0.02, report_every: float = 10.0) -> None:
    """Forever (cancel it): ``observe(seconds late)`` once per wake-up, a log line per window."""
    window: list[float] = []  # (time.perf_counter: uvloop's loop.time() counts whole milliseconds)
    until = time.perf_counter() + report_every
    while True:
        asked = time.perf_counter() + interval
        await asyncio.sleep(interval)
        now = time.perf_counter()
        lag = max(0.0, now - asked)
        observe(lag)
        window.append(lag)
        if now >= until:
            if max(window) > REPORT_OVER_S:
                log.info("event_loop_lag", **summary(window))
            window, until = [], now + report_every


def summary(lags: list[float]) -> dict:
    """Wake-ups and their p50 / p99 / max lag in ms."""
    xs = sorted(lags)

    def at(q: float) -> float:
        return round(xs[min(len(xs) - 1, int(q * len(xs)))] * 1e3, 2)

    return {"wakeups": len(xs), "p50_ms": at(0.5), "p99_ms": at(0.99), "max_ms": at(1.0)}
