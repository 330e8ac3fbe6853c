"""Prometheus metrics of worker rank 0, one update per step, served on ``--metrics-port``
(``GET /metrics``) by prometheus_client's HTTP server thread."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from shared.gc_pause import GcPauses
from shared.logging import get_logger
from shared.metrics_http import serve_metrics

log = get_logger("worker")
FORWARD_BUCKETS = (0.0005, 0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5,
                   1.0, 2.5, 5.0, 10.0)
MASK_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.5)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class WorkerMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.forward = Histogram("banyan:forward_time_seconds", "Worker time per step: forward, sampling, outputs",
                                 buckets=FORWARD_BUCKETS, registry=r)
        self.batch_size = Histogram("banyan:forward_batch_size", "Requests per step", buckets=BATCH_BUCKETS, registry=r)
        self.tokens = Counter("banyan:forward_tokens", "Tokens computed (prompt chunks + decode)", registry=r)
        self.failures = Counter("banyan:forward_failures", "Steps that failed (their requests fail)", registry=r)
        self.busy = Counter("banyan:gpu_busy_seconds", "Device time of the steps (first input copy to last "
                            "output copy; host clock on CPU)", registry=r)
        self.idle = Counter("banyan:gpu_idle_seconds", "Device idle time between consecutive steps while the "
                            "scheduler had work (host work not hidden behind the device)", registry=r)
        self.mask_fill = Histogram("banyan:grammar_mask_fill_seconds", "Scheduler time filling one step's grammar "
                                   "bitmask (xgrammar, on the CPU)", buckets=MASK_BUCKETS, registry=r)
        self.mask_wait = Histogram("banyan:grammar_mask_wait_seconds", "Worker time waiting for a deferred bitmask "
                                   "(after the forward was queued and the previous step answered)",
                                   buckets=MASK_BUCKETS, registry=r)
        self.cascade = Counter("banyan:cascade_steps", "Steps run with shared-prefix (cascade) attention: a prefix "
                               "shared by a group of requests read once for the group", registry=r)
        self.kv_pool = Gauge("banyan:kv_pool_tokens", "Tokens the KV pool holds (per rank; FP8 KV holds twice "
                             "as many as bf16 in the same memory)", ["kv_cache_dtype"], registry=r)
        self.kv_bytes = Gauge("banyan:kv_pool_bytes_per_token", "KV bytes per token (all layers, this rank's heads)",
                              ["kv_cache_dtype"], registry=r)
        self.weights = Gauge("banyan:weight_bytes", "Bytes of this rank's weights", ["quantization"], registry=r)
        kinds = ("kind: decode_graph / decode_eager (decodes only), mixed (decodes and prompt chunks), prefill; "
                 "decode_, mixed_, prefill_piecewise (the work between attentions from piecewise graphs)")
        self.step_device = Histogram("banyan:step_device_seconds", f"Device time per step, by {kinds}", ["kind"],
                                     buckets=FORWARD_BUCKETS, registry=r)
        self.step_idle = Counter("banyan:step_idle_seconds", f"Device idle time before a step, by {kinds}", ["kind"],
                                 registry=r)
        self.step_tokens = Counter("banyan:step_tokens", f"Tokens computed, by the step's {kinds}", ["kind"],
                                   registry=r)
        self.step_host = Histogram("banyan:step_host_seconds", f"Host time queueing a step (its launch), by {kinds}",
                                   ["kind"], buckets=FORWARD_BUCKETS, registry=r)
        self.step_turnaround = Histogram(
            "banyan:step_turnaround_seconds", "From answering step N to receiving step N+2, which the scheduler "
            f"builds once it has applied N (its host work per step, as the worker sees it), by {kinds}", ["kind"],
            buckets=FORWARD_BUCKETS, registry=r)
        GcPauses(r)
        self._server = None

    def model(self, pool_tokens: int, kv_bytes_per_token: int, kv_cache_dtype: str, weight_bytes: int,
              quantization: str) -> None:
        """What the worker serves with (set once, at start)."""
        self.kv_pool.labels(kv_cache_dtype).set(pool_tokens)
        self.kv_bytes.labels(kv_cache_dtype).set(kv_bytes_per_token)
        self.weights.labels(quantization or "none").set(weight_bytes)

    def serve(self, port: int) -> None:
        """Start the HTTP server thread (``port`` 0: none)."""
        if port:
            self._server = serve_metrics(port, self.registry)
            log.info("metrics_listening", port=port)

    def step(self, seconds: float, batch_size: int, tokens: int, busy: float = 0.0, idle: float = 0.0,
             cascade: bool = False, kind: str = "") -> None:
        self.forward.observe(seconds)
        if kind:
            self.step_device.labels(kind).observe(busy)
            self.step_idle.labels(kind).inc(idle)
            self.step_tokens.labels(kind).inc(tokens)
        if cascade:
            self.cascade.inc()
        self.busy.inc(busy)
        self.idle.inc(idle)
        self.batch_size.observe(batch_size)
        self.tokens.inc(tokens)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
