"""Prometheus metrics of a tokenizer replica, served as text on ``GET /metrics``.

A small start (HTTP requests by endpoint and status, requests in flight); the metrics issue
extends it. Each replica keeps its own registry: a scrape through the shared port sees one replica.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest


class TokenizerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.http_requests = Counter("banyan_http_requests", "HTTP requests answered, by endpoint and status",
                                     ["endpoint", "status"], registry=self.registry)
        self.http_in_flight = Gauge("banyan_http_requests_in_flight", "HTTP requests being answered, by endpoint",
                                    ["endpoint"], registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)
