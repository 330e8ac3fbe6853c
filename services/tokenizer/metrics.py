"""Prometheus metrics of the tokenizer tier, served as text on ``GET /metrics`` of the HTTP port.

The tokenizer sees what the client sees, so the request latencies are measured here, from
``received`` (before tokenization): ``banyan:time_to_first_token_seconds`` (per request, the
first token of any branch), ``banyan:inter_token_latency_seconds`` (per branch, one per token after
its first; tokens that arrive together share the gap), ``banyan:e2e_request_latency_seconds`` (requests that completed). Counters, per
request when it ends: ``banyan:prompt_tokens_total``, ``banyan:generation_tokens_total``,
``banyan:cached_tokens_total`` (as the response's usage counts them: the prompt once, its cached
tokens the least any branch reused) and ``banyan:request_success_total{finish_reason}`` per
branch (stop | length | abort — aborted on the server or by the client going away — | error).
Plus HTTP requests by endpoint and status, and requests in flight.

Replicas share the port, so a scrape reaches any one of them: with ``PROMETHEUS_MULTIPROC_DIR``
set (``banyan serve`` gives its tokenizers one per run), every replica writes its values there
and each scrape sums all of them (prometheus_client's multiprocess mode). Without it each replica
reports its own values. ``banyan:event_loop_lag_seconds``: how late the loop runs what is ready
(``shared/loop_lag.py``): every request's ``received`` and every token out waits that long.
``banyan:gc_pause_seconds{generation}``: Python GC pauses (``shared/gc_pause.py``;
in multiprocess mode every replica's, observed once a second from the loop; ``banyan:gc_frozen_objects``
only without it).
"""

from __future__ import annotations

import os

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from shared.gc_pause import PAUSE_BUCKETS, GcPauses
from shared.loop_lag import LAG_BUCKETS
from shared.messages.common import FinishReason

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
               0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 60.0, 120.0, 240.0, 480.0,
               960.0, 1920.0, 7680.0)


class TokenizerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.multiprocess_dir = os.environ.get(MULTIPROC_ENV, "")
        r = self.registry = CollectorRegistry()
        self.http_requests = Counter("banyan_http_requests", "HTTP requests answered, by endpoint and status",
                                     ["endpoint", "status"], registry=r)
        self.http_in_flight = Gauge("banyan_http_requests_in_flight", "HTTP requests being answered, by endpoint",
                                    ["endpoint"], registry=r, multiprocess_mode="livesum")
        self.ttft = Histogram("banyan:time_to_first_token_seconds", "Time from received to the first token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("banyan:inter_token_latency_seconds", "Time between tokens of a branch (tokens arriving together share the gap)",
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("banyan:e2e_request_latency_seconds", "Time from received to the last output",
                             buckets=E2E_BUCKETS, registry=r)
        self.prompt_tokens = Counter("banyan:prompt_tokens", "Prompt tokens of requests served", registry=r)
        self.generation_tokens = Counter("banyan:generation_tokens", "Tokens generated", registry=r)
        self.cached_tokens = Counter("banyan:cached_tokens", "Prompt tokens whose KV came from the prefix cache",
                                     registry=r)
        self.finished = Counter("banyan:request_success", "Request branches ended, by finish reason",
                                ["finish_reason"], registry=r)
        for reason in FinishReason:  # present from the start, at 0
            self.finished.labels(reason)
        self.loop_lag = Histogram("banyan:event_loop_lag_seconds", "How late the tokenizer's event loop woke a "
                                  "task that asked to wake (shared/loop_lag.py)", buckets=LAG_BUCKETS, registry=r)
        if self.multiprocess_dir:  # (a custom collector would not be summed: a histogram, fed from the loop)
            self.gc_flush = GcPauses.mirror(Histogram(
                "banyan:gc_pause_seconds", "Python cyclic-GC pauses of the tokenizer processes, by generation",
                ["generation"], buckets=PAUSE_BUCKETS, registry=r))
        else:
            GcPauses(r)
            self.gc_flush = lambda: None

    def request_ended(self, e2e: float | None, gaps: list[float], prompt_tokens: int, generated: int,
                      cached_tokens: int, reasons: list[str]) -> None:
        """Once per request, when it ends: ``e2e`` None unless it completed; ``gaps`` its
        inter-token latencies (all branches)."""
        if e2e is not None:
            self.e2e.observe(e2e)
        for g in gaps:
            self.itl.observe(g)
        if prompt_tokens:
            self.prompt_tokens.inc(prompt_tokens)
            self.cached_tokens.inc(cached_tokens)
        if generated:
            self.generation_tokens.inc(generated)
        for reason in reasons:
            self.finished.labels(reason).inc()

    def render(self) -> bytes:
        if self.multiprocess_dir:
            from prometheus_client import multiprocess

            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry, path=self.multiprocess_dir)
            return generate_latest(registry)
        return generate_latest(self.registry)
