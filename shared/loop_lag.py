"""How late an asyncio loop runs what is ready: a task asks to wake every ``interval`` seconds and
observes how much later than asked it woke. Under a loop that is busy (a tokenizer detokenizing
and writing ~10k streamed tokens a second, a GC pause, a slow handler) every new request's
``received`` stage, and every token on its way out, waits that long too — a delay the stage lines
cannot show, since they are written by the same loop. ``banyan:event_loop_lag_seconds``."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

LAG_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


async def watch_lag(observe: Callable[[float], None], interval: float = 0.02) -> None:
    """Forever (cancel it): ``observe(seconds late)`` once per wake-up."""
    loop = asyncio.get_running_loop()
    while True:
        asked = loop.time() + interval
        await asyncio.sleep(interval)
        observe(max(0.0, loop.time() - asked))
