"""OpenTelemetry span export (the ``otel`` extra). Imported only by ``tracing.make_tracer`` when an
OTLP endpoint is configured.

The protocol is OpenTelemetry's own setting, ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` (or
``OTEL_EXPORTER_OTLP_PROTOCOL``): ``grpc`` (the default; ``host:4317``) or ``http/protobuf``
(``http://host:4318``, ``/v1/traces`` added when the URL has no path). An endpoint without a
scheme is plain text (``http://``); give ``https://`` for TLS. Batching and timeouts follow the
``OTEL_BSP_*`` variables.
"""

from __future__ import annotations

import logging
import os
from urllib.parse import urlparse

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from shared.logging import get_logger

log = get_logger("tracing")
_PROPAGATOR = TraceContextTextMapPropagator()


def _exporter(endpoint: str):
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
                              os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"))
    if "://" not in endpoint:
        endpoint = "http://" + endpoint
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(endpoint=endpoint)
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

        if urlparse(endpoint).path in ("", "/"):
            endpoint = endpoint.rstrip("/") + "/v1/traces"
        return HttpExporter(endpoint=endpoint)
    raise ValueError(f"unsupported OTLP traces protocol {protocol!r} (grpc | http/protobuf)")


class _SaidOnce(SpanExporter):
    """The OTLP exporter, its failures said once: the exporter itself logs a line for every retry of
    every batch ("Transient error … retrying in 1s", then "Failed to export …"), forever while no
    collector listens. Each batch's retries stay bounded by the exporter's timeout
    (``OTEL_EXPORTER_OTLP_TIMEOUT``, 10 s); its own lines are silenced, and this logs
    ``otlp_export_failed`` once when exports start failing (the spans are dropped) and
    ``otlp_export_resumed`` when they work again."""

    def __init__(self, inner: SpanExporter, endpoint: str) -> None:
        self.inner, self.endpoint, self.failing = inner, endpoint, False

    def export(self, spans) -> SpanExportResult:
        result = self.inner.export(spans)
        if result is SpanExportResult.FAILURE and not self.failing:
            self.failing = True
            log.warning("otlp_export_failed", endpoint=self.endpoint, spans=len(spans),
                        note="no collector answers: spans are dropped until one does (said once)")
        elif result is SpanExportResult.SUCCESS and self.failing:
            self.failing = False
            log.info("otlp_export_resumed", endpoint=self.endpoint)
        return result

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return self.inner.force_flush(timeout_millis)


class _OtelSpan:
    """A ``shared.tracing.Span`` that records an OpenTelemetry span (same interface; this module
    does not import ``shared.tracing``, which imports it lazily)."""

    __slots__ = ("_span", "traceparent")

    def __init__(self, span) -> None:
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
        self.traceparent = carrier.get("traceparent", "")
        self._span = span

    def end(self, **attributes) -> None:
        if attributes:
            self._span.set_attributes(attributes)
        self._span.end()


class OtelTracer:
    """A ``shared.tracing.Tracer`` exporting its spans over OTLP."""

    enabled = True

    def __init__(self, service: str, endpoint: str) -> None:
        self.provider = TracerProvider(resource=Resource.create({"service.name": f"banyan-{service}"}))
        logging.getLogger("opentelemetry.exporter.otlp").setLevel(logging.CRITICAL)  # (said once: _SaidOnce)
        self.provider.add_span_processor(BatchSpanProcessor(_SaidOnce(_exporter(endpoint), endpoint)))
        self.tracer = self.provider.get_tracer("banyan")
        # the tokenizer serves the client; the scheduler and the worker take messages off a queue
        self.kind = trace.SpanKind.SERVER if service == "tokenizer" else trace.SpanKind.CONSUMER
        log.info("otlp_export", endpoint=endpoint)

    def start(self, name: str, traceparent: str, start_ns: int | None = None, **attributes) -> _OtelSpan:
        ctx = _PROPAGATOR.extract({"traceparent": traceparent}) if traceparent else None
        span = self.tracer.start_span(name, context=ctx, kind=self.kind, start_time=start_ns,
                                      attributes=attributes)
        return _OtelSpan(span)

    def shutdown(self) -> None:
        self.provider.shutdown()
