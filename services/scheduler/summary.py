"""The scheduler's periodic ``summary`` log line (``--log-interval`` seconds; 0: off).

The scheduler calls ``Summary.tick`` once per loop iteration with its current numbers: requests
running and queued, its cumulative token counters, the KV pool's use. When the interval has
passed since the last line, one ``summary`` line is logged with the rates over that interval::

    {"event": "summary", "running": 12, "queued": 3, "tokens_in_per_s": 812.4, "tokens_out_per_s": 402.1,
     "cache_hit_rate": 0.46, "kv_usage": 0.31, "interval_s": 10.0, ...}

``tokens_in_per_s``: prompt tokens prefilled (computed or taken from the prefix cache) per second;
``tokens_out_per_s``: decode tokens per second; ``cache_hit_rate``: cached ÷ prompt tokens of the
requests prefilled in the interval (None when none was); ``kv_usage``: the fraction of the KV pool
held by running requests (as the ``banyan:kv_cache_usage`` gauge). An idle server logs one line
after its work stops, then nothing until work comes back.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from shared.logging import get_logger

log = get_logger("scheduler")


class Summary:
    def __init__(self, interval: float, clock: Callable[[], float] = time.monotonic, logger=None) -> None:
        self.interval = interval
        self.clock = clock
        self.log = logger or log
        self._last: tuple[float, int, int, int] | None = None  # (time, prompt, cached, generated) at the last line
        self._idle_logged = False

    def tick(self, running: int, waiting: int, prompt_tokens: int, cached_tokens: int, generated_tokens: int,
             kv_used: int, kv_pool: int) -> bool:
        """Called once per scheduler loop iteration. ``prompt_tokens``, ``cached_tokens`` (the part of
        them served from the prefix cache) and ``generated_tokens`` count since start; ``kv_used`` of
        ``kv_pool`` KV slots are held by running requests. True when it logged a line."""
        if self.interval <= 0:
            return False
        now = self.clock()
        if self._last is None:
            self._last = (now, prompt_tokens, cached_tokens, generated_tokens)
            return False
        t0, p0, c0, g0 = self._last
        if now - t0 < self.interval:
            return False
        # counters that went back (the scheduler's state was reset: a lost worker) restart from 0
        dp = prompt_tokens - p0 if prompt_tokens >= p0 else prompt_tokens
        dc = cached_tokens - c0 if cached_tokens >= c0 else cached_tokens
        dg = generated_tokens - g0 if generated_tokens >= g0 else generated_tokens
        self._last = (now, prompt_tokens, cached_tokens, generated_tokens)
        idle = not (running or waiting or dp or dg)
        if idle and self._idle_logged:
            return False
        self._idle_logged = idle
        dt = now - t0
        self.log.info("summary", running=running, queued=waiting, tokens_in_per_s=round(dp / dt, 1),
                      tokens_out_per_s=round(dg / dt, 1), cache_hit_rate=round(dc / dp, 4) if dp else None,
                      kv_usage=round(kv_used / kv_pool, 4) if kv_pool else 0.0, interval_s=round(dt, 3))
        return True
