"""W3C trace context for requests, and optional OpenTelemetry spans.

Every request has a ``traceparent`` (``00-<trace id>-<span id>-<flags>``): the one the client sent
in gRPC metadata or an HTTP header, or a new one made at ``received`` when it sent none (or an
invalid one). It travels in every internal message (``GenerateReq``, ``NewReq``), and every stage
log line of the request carries its ``trace_id`` in all three processes.

Spans are exported only when an OTLP endpoint is configured (``--otlp-endpoint``): then
``make_tracer`` imports OpenTelemetry (``shared.otel``, the ``otel`` extra) and each service makes
one span per request — tokenizer ``generate``, scheduler ``schedule``, worker ``forward`` — each
the child of the traceparent it received, and hands its own span's traceparent downstream.
Without an endpoint nothing of OpenTelemetry is imported and a span is the traceparent passed on.
"""

from __future__ import annotations

import re
import secrets
import time
from dataclasses import dataclass, field

_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?")
_ZERO_TRACE, _ZERO_SPAN = "0" * 32, "0" * 16


def parse(traceparent: str | None) -> tuple[str, str, str] | None:
    """(trace id, parent span id, flags) of a valid W3C ``traceparent``, else None."""
    if not traceparent:
        return None
    m = _TRACEPARENT.fullmatch(traceparent.strip().lower())
    if m is None:
        return None
    version, trace_id, span_id, flags, rest = m.groups()
    if version == "ff" or (version == "00" and rest) or trace_id == _ZERO_TRACE or span_id == _ZERO_SPAN:
        return None
    return trace_id, span_id, flags


def new_traceparent(trace_id: str = "", flags: str = "01") -> str:
    """A new span id in ``trace_id`` (a new trace when empty), sampled by default."""
    return f"00-{trace_id or secrets.token_hex(16)}-{secrets.token_hex(8)}-{flags}"


def ensure(traceparent: str | None) -> str:
    """The incoming traceparent (normalized) when valid, else the start of a new trace."""
    parsed = parse(traceparent)
    if parsed is None:
        return new_traceparent()
    trace_id, span_id, flags = parsed
    return f"00-{trace_id}-{span_id}-{flags}"


def trace_id(traceparent: str | None) -> str:
    """The trace id of a traceparent ("" when it is not valid)."""
    parsed = parse(traceparent)
    return parsed[0] if parsed else ""


@dataclass(frozen=True)
class Trace:
    """A request's trace context in the process that received it, and when it was received."""

    traceparent: str
    start_ns: int = field(default_factory=time.time_ns)  # wall clock: span start
    start: float = field(default_factory=time.monotonic)  # for latencies (TTFT, e2e)

    @classmethod
    def incoming(cls, header: str | None) -> Trace:
        return cls(ensure(header))

    @property
    def trace_id(self) -> str:
        return self.traceparent[3:35]


class Span:
    """A span that records nothing: it passes its parent's traceparent on."""

    __slots__ = ("traceparent",)

    def __init__(self, traceparent: str) -> None:
        self.traceparent = traceparent

    def end(self, **attributes) -> None:
        pass


class Tracer:
    """Starts one span per request per service. This base class exports nothing."""

    enabled = False

    def start(self, name: str, traceparent: str, start_ns: int | None = None, **attributes) -> Span:
        return Span(traceparent)

    def shutdown(self) -> None:
        """Export what is pending (called once, when the service stops)."""


def make_tracer(service: str, otlp_endpoint: str) -> Tracer:
    """A tracer exporting to ``otlp_endpoint``, or one that exports nothing (and imports nothing)
    when it is empty."""
    if not otlp_endpoint:
        return Tracer()
    from shared.otel import OtelTracer

    return OtelTracer(service, otlp_endpoint)
