"""Prometheus metrics of the scheduler, updated once per step (never per token), served on
``--metrics-port`` (``GET /metrics``) by prometheus_client's HTTP server thread.

- ``banyan:queue_time_seconds``: queued → first scheduled, per request branch (a retracted
  request resuming is not observed again).
- ``banyan:num_running_requests`` / ``banyan:num_waiting_requests``: after each step (waiting
  includes requests whose grammar is compiling).
- ``banyan:kv_cache_usage``: the fraction of the KV pool held by running requests (their own slots
  and the cached prefixes they lock). Cached prefixes nobody holds are reclaimable on demand and
  do not count (vLLM's ``kv_cache_usage_perc`` counts the same way); they are
  ``banyan:kv_cache_evictable_tokens``.
- ``banyan:cache_hit_rate``: prompt tokens whose KV came from the prefix cache ÷ prompt tokens,
  over every request prefilled since start (for a windowed rate, divide the ``rate()`` of the
  tokenizer's ``banyan:cached_tokens_total`` by that of ``banyan:prompt_tokens_total``).
- ``banyan:retractions_total``, ``banyan:grammar_compile_seconds``.
- Fleet gauges with the Kubernetes Gateway API Inference Extension's model-server protocol
  semantics (its endpoint picker scrapes them: ``--total-queued-requests-metric
  banyan:num_requests_waiting --kv-cache-usage-percentage-metric banyan:kv_cache_usage_perc``):
  ``banyan:num_requests_waiting`` — TotalQueuedRequests, the requests in the queue, not yet
  running (request branches, as vLLM counts its ``n`` samples; including those whose grammar
  compiles); ``banyan:kv_cache_usage_perc`` — KVCacheUtilization, the KV-cache utilization as a
  fraction 0–1 (1 = full), counted as ``banyan:kv_cache_usage`` (reclaimable cache excluded).
- ``banyan:cascade_steps_total``: steps with shared-prefix (cascade) attention groups;
  ``banyan:cascade_saved_tokens_total``: KV tokens those steps did not read (a shared prefix read
  once per group instead of once per member).
- Priority scheduling: ``banyan:preemptions_total`` (running requests preempted for higher-priority
  ones), ``banyan:shed_requests_total`` (waiting ones dropped from a full queue for them),
  ``banyan:priority_urgent_steps_total`` (steps that admitted one without the lower levels), and per
  priority level (label ``priority``) ``banyan:priority_running_requests``,
  ``banyan:priority_waiting_requests`` (refreshed at most every ``LEVELS_EVERY_S``) and the
  histogram ``banyan:priority_time_to_first_token_seconds`` (queued → first token sampled).
- Sessions and pinned prefixes: ``banyan:num_sessions``, ``banyan:num_pinned_prefixes`` and
  ``banyan:pinned_tokens{kind="session"|"prefix"}`` (KV tokens held pinned, exempt from eviction).
- With the hierarchical cache (a worker with a host tier; ``tiers.py``): ``banyan:cache_hit_rate``
  gets a ``tier`` label — ``all`` (every tier: the rate without the label), ``device``, ``host``,
  ``disk`` (the prompt tokens each tier served, ÷ prompt tokens); ``banyan:hicache_hit_tokens_total
  {tier}`` (host, disk); ``banyan:hicache_used_bytes{tier}`` / ``banyan:hicache_capacity_bytes{tier}``
  (host, disk: per worker rank); ``banyan:hicache_moved_bytes_total{direction}`` and
  ``banyan:hicache_copy_seconds_total{direction}`` (device_to_host, host_to_device, host_to_disk,
  disk_to_host: copies acknowledged); ``banyan:hicache_failures_total{kind}`` (copy, disk_full, corrupt,
  io); ``banyan:hicache_demoted_tokens_total`` (pool evictions copied out on their way: the next forward
  waits for those copies); ``banyan:hicache_fetch_wait_seconds`` (how long a request was kept aside while
  its prefix came back into the pool).
- With ``--step-time-target-ms``: ``banyan:step_model_ms{term}`` — the fitted step-time model (``step_model.py``;
  ``base``, ``per_decode_row``, ``per_prompt_token``, ``prompt_step``) — and ``banyan:step_prompt_budget_tokens``,
  the prompt tokens the last step with decodes could carry.
- ``banyan:gc_pause_seconds{generation}``: Python GC pauses of the scheduler process (``shared/gc_pause.py``;
  the worker and the tokenizer report theirs too).
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from shared.gc_pause import GcPauses
from shared.logging import get_logger
from shared.metrics_http import serve_metrics
from services.scheduler.counters import Counters
from services.scheduler.hicache import HiCache
from services.scheduler.tier_metrics import HitRate, TierMetrics

log = get_logger("scheduler")
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0,
                 320.0, 640.0)
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0,
                640.0)
LEVELS_EVERY_S = 0.25
COMPILE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class SchedulerMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.queue_time = Histogram("banyan:queue_time_seconds", "Time from queued to first scheduled",
                                    buckets=QUEUE_BUCKETS, registry=r)
        self.running = Gauge("banyan:num_running_requests", "Request branches running (in the batch)", registry=r)
        self.waiting = Gauge("banyan:num_waiting_requests", "Request branches waiting to be scheduled", registry=r)
        self.queued = Gauge("banyan:num_requests_waiting", "Requests in the queue, not running yet (Gateway API "
                            "Inference Extension: TotalQueuedRequests)", registry=r)
        self.kv_usage_perc = Gauge("banyan:kv_cache_usage_perc", "KV-cache utilization, 0-1 (Gateway API Inference "
                                   "Extension: KVCacheUtilization; reclaimable cache excluded)", registry=r)
        self.kv_usage = Gauge("banyan:kv_cache_usage",
                              "Fraction of the KV pool held by running requests (evictable cache excluded)",
                              registry=r)
        self.kv_evictable = Gauge("banyan:kv_cache_evictable_tokens",
                                  "KV slots holding cached prefixes no request holds (reclaimable)", registry=r)
        self.hit_rate = HitRate()
        r.register(self.hit_rate)
        GcPauses(r)
        self.retractions = Counter("banyan:retractions", "Requests retracted (KV to the cache, back to the queue)",
                                   registry=r)
        self.grammar_compile = Histogram("banyan:grammar_compile_seconds", "Structured-output grammar compile time",
                                         buckets=COMPILE_BUCKETS, registry=r)
        self.cascade_steps = Counter("banyan:cascade_steps", "Steps with shared-prefix (cascade) attention groups",
                                     registry=r)
        self.cascade_saved = Counter("banyan:cascade_saved_tokens",
                                     "KV tokens not read thanks to shared-prefix groups (read once per group)",
                                     registry=r)
        self.preemptions = Counter("banyan:preemptions", "Running requests preempted for higher-priority ones "
                                   "(they resume later)", registry=r)
        self.shed = Counter("banyan:shed_requests", "Waiting requests dropped from a full queue for higher-priority "
                            "ones", registry=r)
        self.urgent_steps = Counter("banyan:priority_urgent_steps", "Steps that admitted a top-priority request "
                                    "without the lower levels' decodes and chunks", registry=r)
        self.prio_running = Gauge("banyan:priority_running_requests", "Request branches running, by priority",
                                  ["priority"], registry=r)
        self.prio_waiting = Gauge("banyan:priority_waiting_requests", "Request branches queued, by priority",
                                  ["priority"], registry=r)
        self.prio_ttft = Histogram("banyan:priority_time_to_first_token_seconds",
                                   "Time from queued to the first token sampled, by priority", ["priority"],
                                   buckets=TTFT_BUCKETS, registry=r)
        self.sessions = Gauge("banyan:num_sessions", "Sessions open", registry=r)
        self.pins = Gauge("banyan:num_pinned_prefixes", "Prefixes pinned (PinPrefix)", registry=r)
        self.pinned = Gauge("banyan:pinned_tokens", "KV tokens held pinned (exempt from eviction)", ["kind"],
                            registry=r)
        self._step_model: tuple[Gauge, Gauge] | None = None  # (registered with --step-time-target-ms)
        self._retractions = 0
        self._cascade = (0, 0)
        self._shed = (0, 0, 0)
        self._levels: set[int] = set()
        self._anchors = (-1, -1, -1, -1)
        self._levels_at = 0.0
        self._server = None
        self.tiers: TierMetrics | None = None  # registered with the first engine that has a host tier

    def serve(self, port: int) -> None:
        """Start the HTTP server thread (``port`` 0: none)."""
        if port:
            self._server = serve_metrics(port, self.registry)
            log.info("metrics_listening", port=port)

    def step(self, running: int, waiting: int, kv_pool: int, kv_free: int, kv_evictable: int, c: Counters,
             queue_times: list[float], hicache: HiCache | None = None) -> None:
        """One update per scheduler step (or idle pass), from the scheduler's own totals."""
        self.running.set(running)
        self.waiting.set(waiting)
        self.queued.set(waiting)
        usage = (kv_pool - kv_free - kv_evictable) / kv_pool if kv_pool else 0.0
        self.kv_usage.set(usage)
        self.kv_usage_perc.set(usage)
        self.kv_evictable.set(kv_evictable)
        if c.prompt:
            self.hit_rate.value = c.prefill_cached / c.prompt
        if hicache is not None:
            if self.tiers is None:
                self.tiers = TierMetrics(self.registry)
            self.tiers.update(c, hicache)
            self.hit_rate.tiers = self.tiers.hit_rates(c)
        if c.retractions > self._retractions:
            self.retractions.inc(c.retractions - self._retractions)
            self._retractions = c.retractions
        for q in queue_times:
            self.queue_time.observe(q)
        if c.cascade_steps > self._cascade[0]:
            self.cascade_steps.inc(c.cascade_steps - self._cascade[0])
            self.cascade_saved.inc(c.cascade_saved - self._cascade[1])
            self._cascade = (c.cascade_steps, c.cascade_saved)
        if (c.preemptions, c.shed, c.urgent_steps) != self._shed:
            self.preemptions.inc(c.preemptions - self._shed[0])
            self.shed.inc(c.shed - self._shed[1])
            self.urgent_steps.inc(c.urgent_steps - self._shed[2])
            self._shed = (c.preemptions, c.shed, c.urgent_steps)

    def step_model(self, ms: dict[str, float], budget: int) -> None:
        """The step-time model's terms (ms) and the last prompt budget it gave (``--step-time-target-ms``)."""
        if self._step_model is None:
            self._step_model = (Gauge("banyan:step_model_ms", "Fitted step device time terms, ms (base, per decode "
                                      "row, per prompt token, a step with prompt tokens)", ["term"],
                                      registry=self.registry),
                                Gauge("banyan:step_prompt_budget_tokens", "Prompt tokens the last step with decodes "
                                      "could carry under --step-time-target-ms", registry=self.registry))
        terms, gauge = self._step_model
        for term, value in ms.items():
            terms.labels(term).set(value)
        gauge.set(budget)

    def anchors(self, sessions: int, session_tokens: int, pins: int, pinned_tokens: int) -> None:
        if (sessions, session_tokens, pins, pinned_tokens) == self._anchors:
            return
        self._anchors = (sessions, session_tokens, pins, pinned_tokens)
        self.sessions.set(sessions)
        self.pins.set(pins)
        self.pinned.labels("session").set(session_tokens)
        self.pinned.labels("prefix").set(pinned_tokens)

    def by_priority(self, running: Iterable, waiting: Iterable, first_tokens: list[tuple[int, float]]) -> None:
        """Priority scheduling: the TTFTs of the requests that got their first token (drained), and,
        at most every ``LEVELS_EVERY_S``, the running / waiting counts per level (levels that
        emptied read 0)."""
        for priority, seconds in first_tokens:
            self.prio_ttft.labels(str(priority)).observe(seconds)
        first_tokens.clear()
        now = time.monotonic()
        if now - self._levels_at < LEVELS_EVERY_S:
            return
        self._levels_at = now
        counts: dict[int, list[int]] = {}
        for i, reqs in enumerate((running, waiting)):
            for r in reqs:
                counts.setdefault(r.priority, [0, 0])[i] += 1
        for level in self._levels | set(counts):
            run, wait = counts.get(level, (0, 0))
            self.prio_running.labels(str(level)).set(run)
            self.prio_waiting.labels(str(level)).set(wait)
        self._levels |= set(counts)

    def grammar_compiled(self, seconds: list[float]) -> None:
        for s in seconds:
            self.grammar_compile.observe(s)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
