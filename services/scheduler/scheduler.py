"""The scheduler process: owns every request's metadata and the KV bookkeeping, runs continuous
batching, and talks to tokenizer replicas (ROUTER) and worker rank 0 (DEALER, ``worker_link.py``).

State by lifetime: the process (config, sockets, the ``RequestTable`` with its outbox, ``Counters``,
metrics), the attached worker (an ``EngineSession``: model info, KV manager, batcher, grammar
backend, steps in flight — built on ``WorkerReady``, dropped when the worker is lost, which fails
every request with UNAVAILABLE until a new worker is ready), and the request (``Req``).
"""

from __future__ import annotations

import signal
import time

import zmq

from shared import knobs
from shared.config import SchedulerConfig
from shared.gc_pause import FullCollections
from shared.logging import get_logger
from shared.messages.codec import Codec
from shared.messages.common import ErrorCode, FinishReason
from shared.messages.to_scheduler import (AbortReq, CacheAck, FlushCacheReq, GenerateReq, KvSubscribe, LoadReq,
                                          SessionOp, StepOutput, ToScheduler, TokenizerHello, UnpinReq, WorkerError,
                                          WorkerReady)
from shared.messages.to_tokenizer import EngineStatus, ToTokenizer
from shared.messages.to_worker import Shutdown, WorkerSetup
from shared.transport import RouterQueue
from shared.tracing import make_tracer
from services.scheduler.batcher import Scheduled
from services.scheduler.counters import Counters
from services.scheduler.engine import EngineSession
from services.scheduler.grammar import GrammarBackend, early_tokenizer
from services.scheduler.intake import Intake, load_of, num_waiting
from services.scheduler.kv_events import KvEventPublisher, flush_cache
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.outputs import StepApplier
from services.scheduler.request import Status
from services.scheduler.requests import RequestTable
from services.scheduler.step_io import with_extras
from services.scheduler.summary import Summary
from services.scheduler.worker_link import WorkerLink

log = get_logger("scheduler")
CHECK_EVERY_STEP = knobs.get("check_integrity")  # (tests and debugging: the KV books every step)


class Scheduler:
    def __init__(self, cfg: SchedulerConfig) -> None:
        self.cfg = cfg
        self.ctx = zmq.Context()
        inbox: Codec = Codec(ToScheduler)
        self.tok = RouterQueue(self.ctx, cfg.tokenizer_endpoint, inbox, Codec(ToTokenizer))
        self.worker = WorkerLink(self.ctx, cfg.worker_endpoint, inbox, cfg.worker_timeout)
        self.poller = zmq.Poller()
        for sock in (self.tok.sock, self.worker.sock, self.worker.monitor.sock):
            self.poller.register(sock, zmq.POLLIN)
        self.replicas: set[bytes] = set()  # tokenizer replicas that said hello
        self.table = RequestTable(self.tok.send)
        self.counters = Counters()
        self.metrics = SchedulerMetrics()
        self.summary = Summary(cfg.log_interval)  # the periodic ``summary`` log line
        self.gc = FullCollections(cfg.gc_full_interval)  # not every few dozen steps under load
        self.tracer = make_tracer("scheduler", cfg.otlp_endpoint)
        self.intake = Intake(cfg, self.table, self.counters, self.tracer, self.tok.send)
        self.engine: EngineSession | None = None  # None: not serving (no worker ready yet, or it was lost)
        self.applier: StepApplier | None = None  # (the engine's)
        self.grammar: GrammarBackend | None = None  # outlives engines (rebuilt for another vocabulary)
        self.tokenizer = early_tokenizer(cfg.model)  # (the grammar compiler's: loading while the worker starts)
        self.down = ""  # why not serving, once a worker was lost
        self.stopping = False
        self.kv_events = KvEventPublisher(cfg.page_size, self.tok.send, cfg.kv_events_block_size,
                                          cfg.kv_events_endpoint, cfg.kv_events_topic, self.ctx)

    # ---- main loop -------------------------------------------------------------------------
    def run(self) -> None:
        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "stopping", True))
        signal.signal(signal.SIGINT, lambda *_: setattr(self, "stopping", True))
        self.loop()

    def loop(self) -> None:
        log.info("scheduler_start", tokenizer_endpoint=self.cfg.tokenizer_endpoint,
                 worker_endpoint=self.cfg.worker_endpoint)
        self.metrics.serve(self.cfg.metrics_port)
        table = self.table
        while not self.stopping:
            e = self.engine  # (waiting requests kept aside for a tier copy wake the loop with its ack)
            if e is not None and e.grammar.pending:  # (compiled meanwhile, or cached: queued before the poll)
                self._poll_grammars(e)
            busy = bool(table.running or (e is not None and e.busy) or
                        len(table.waiting) > (e.blocked if e is not None else 0))
            compiling = e is not None and bool(e.grammar.pending)
            self._poll(0 if busy else 5 if compiling else 100)
            self.kv_events.flush()  # the last step's cache changes, to whoever subscribed
            e = self.engine
            if e is None:
                continue
            if e.grammar.pending:  # (after the poll: a request whose grammar is cached is ready now, not a poll later)
                self._poll_grammars(e)
            e.expire(time.monotonic())
            table.apply_aborts(e.kv)
            table.flush()  # aborts of requests that are not in the next batch end their streams now
            if e.hicache is not None:
                e.hicache.step()
            if CHECK_EVERY_STEP:
                e.kv.check_integrity(table.running)
            sched = e.batcher.build(table.running, table.waiting)
            if e.hicache is not None:  # tier copies go first: the batch may depend on them
                e.hicache.flush(self.worker.send, sched)
            if sched is None and e.inflight is None:
                if not busy:
                    e.kv.check_integrity(table.running)
                    self._update_metrics(e, [])
                    self.gc.idle()
                e.last_built = False
                continue
            if sched is not None:
                # overlap: the step in flight decides what the grammar allows next: its mask follows
                sched.msg = with_extras(sched, e.grammar, defer_mask=e.inflight is not None, follows=e.last_built)
                self.worker.send(sched.msg)
                self.gc.busy()  # (a due full collection: while the worker has two steps to run)
            e.last_built = sched is not None
            if e.inflight is not None:
                # the next step's deferred mask goes out as soon as the matchers have advanced
                if not self._complete(e, e.inflight, sched if sched is not None and sched.msg.mask_deferred else None):
                    continue  # the worker was lost: every request failed
            e.inflight = None
            if sched is not None:
                if self.cfg.disable_overlap_schedule:
                    if not self._complete(e, sched):
                        continue
                else:
                    e.inflight = sched
            table.apply_aborts(e.kv)
            table.flush()
            self._update_metrics(e, sched.queue_s if sched is not None else [])
        self._shutdown()

    def _poll(self, timeout_ms: int) -> None:
        """Handle every pending message from tokenizers and the worker."""
        events = dict(self.poller.poll(timeout_ms))
        if self.tok.sock in events:
            while (item := self.tok.recv_nowait()) is not None:
                self._on_tokenizer(*item)
        if self.worker.sock in events:
            while (msg := self.worker.recv_nowait()) is not None:
                self._on_worker(msg)
        self._check_worker()

    def _check_worker(self, step: int = -1, since: float = 0.0) -> bool:
        reason = self.worker.lost(step, since)
        if reason:
            self._detach(reason)
        return bool(reason)

    def _complete(self, e: EngineSession, sched: Scheduled, mask_for: Scheduled | None = None) -> bool:
        """Wait for ``sched``'s results and apply them (or fail its requests), sending the deferred
        mask of ``mask_for`` (the step after it) on the way; False: the worker was lost meanwhile
        (every request failed, the engine dropped)."""
        since = time.monotonic()
        while sched.step_id not in e.answers:
            self._poll(1000)
            if self.engine is not e or (sched.step_id not in e.answers and self._check_worker(sched.step_id, since)):
                return False  # (lost, or replaced by a restarted worker: its answers will never come)
        out = e.answers.pop(sched.step_id)
        if isinstance(out, StepOutput):
            self.applier.apply(sched, out, mask_for)
            if e.batcher.limits.step_target_ms:  # (the step-time model learns from every answered step)
                e.batcher.step_model.observe(sched.num_tokens - sched.prefill_tokens, sched.prefill_tokens,
                                             out.busy_ms)
        else:
            self.applier.fail(sched, out, mask_for)
        return True

    # ---- inputs ----------------------------------------------------------------------------
    def _on_tokenizer(self, ident: bytes, msg) -> None:
        if isinstance(msg, GenerateReq):
            self.intake.generate(ident, msg, self.engine, self.down)
        elif isinstance(msg, (SessionOp, UnpinReq)):
            self.intake.control(ident, msg, self.engine, self.down)
        elif isinstance(msg, AbortReq):
            self.table.abort(ident, msg)
        elif isinstance(msg, TokenizerHello):
            log.info("tokenizer_connected", replica=msg.replica)
            self.replicas.add(ident)
            if self.engine is not None:  # (else: when the worker is ready)
                self.tok.send(ident, self.engine.info)
        elif isinstance(msg, LoadReq):
            self.tok.send(ident, load_of(msg.token, self.counters, self.table, self.engine))
        elif isinstance(msg, KvSubscribe):
            self.kv_events.subscribe(ident, msg.on)
        elif isinstance(msg, FlushCacheReq):
            busy = sum(1 for _ in self.table.live())
            self.tok.send(ident, flush_cache(msg.token, busy, self.engine.kv.cache if self.engine else None))

    def _poll_grammars(self, e: EngineSession) -> None:
        ready, failed = e.grammar.poll()
        times = e.grammar.compile_ms
        if times:
            n = len(times)  # (compile threads append)
            self.metrics.grammar_compiled([ms / 1e3 for ms in times[:n]])
            del times[:n]
        for branches in ready:
            self.table.enqueue(branches)
        for branches, error in failed:
            for r in branches:
                self.table.finish(r, FinishReason.ERROR, e.kv, error=error, code=ErrorCode.INVALID_ARGUMENT)
        if failed:
            self.table.flush()

    def _on_worker(self, msg) -> None:
        if isinstance(msg, (StepOutput, WorkerError)):  # (overlap: it may come while the loop polls)
            if self.engine is not None and self.worker.attached:
                self.engine.answers[msg.step_id] = msg
        elif isinstance(msg, CacheAck):
            if self.engine is not None and self.worker.attached and self.engine.hicache is not None:
                self.engine.hicache.on_ack(msg)
        elif isinstance(msg, WorkerReady):
            self._attach(msg)
        else:
            log.warning("unexpected_worker_message", kind=type(msg).__name__)

    # ---- the worker comes and goes -----------------------------------------------------------
    def _attach(self, w: WorkerReady) -> None:
        """A worker is ready — at start, or a restarted one: a fresh engine sized from its pool,
        ``WorkerSetup`` down, ``ModelInfo`` to every replica (serving again)."""
        restarted = self.grammar is not None
        if self.worker.attached:  # a new worker while the old one looked alive: the old one's state is gone
            self._detach("the worker process restarted")
        e = self.engine = EngineSession.start(self.cfg, w, self.counters, self.grammar, self.tokenizer)
        self.grammar = e.grammar
        self.applier = StepApplier(self.table, e, self.counters, self.worker.send, not self.cfg.disable_jump_forward)
        if self.cfg.enable_priority_scheduling:
            self.applier.first_tokens = []
        self.worker.attach()
        self.kv_events.attach(e.kv.cache)
        self.worker.send(WorkerSetup(max_running_requests=e.info.max_running_requests))
        log.info("worker_ready", restarted=restarted, **{k: getattr(w, k) for k in w.__struct_fields__
                                                         if k != "disk_files"})
        self.down = ""
        for ident in self.replicas:
            self.tok.send(ident, e.info)

    def _detach(self, reason: str) -> None:
        """The worker is lost: fail every request (waiting, compiling, running) with UNAVAILABLE,
        drop the engine (the KV died with the worker), tell every replica it is not serving; new
        requests are refused with ``reason`` until the next ``WorkerReady``."""
        self.worker.detach()
        e, table = self.engine, self.table
        running, waiting = len(table.running), len(table.waiting)
        failed = table.fail_all(f"{reason}: the request was lost, retry it", ErrorCode.UNAVAILABLE, e.kv if e else None)
        log.error("worker_lost", reason=reason, requests=failed, running=running, waiting=waiting)
        if e is not None:
            e.grammar.pending.clear()  # (their requests failed; a compile still running finishes unseen)
        self.engine, self.applier, self.down = None, None, reason
        self.kv_events.detach()
        table.flush()
        for ident in self.replicas:
            self.tok.send(ident, EngineStatus(serving=False, reason=reason))

    # ---- reporting ---------------------------------------------------------------------------
    def _update_metrics(self, e: EngineSession, queue_times: list[float]) -> None:
        c, kv, running, waiting = self.counters, e.kv, len(self.table.running), num_waiting(self.table, e)
        self.metrics.step(running, waiting, kv.pool_size, kv.slots.num_free, kv.evictable, c, queue_times, e.hicache)
        self.metrics.anchors(len(e.sessions.sessions), e.sessions.tokens, len(e.pins.pins), e.pins.tokens)
        if self.cfg.step_time_target_ms:
            m = e.batcher.step_model
            self.metrics.step_model({"base": m.base_ms, "per_decode_row": m.row_ms, "per_prompt_token": m.token_ms,
                                     "prompt_step": m.prompt_step_ms},
                                    e.batcher.last_prompt_budget)
        if self.cfg.enable_priority_scheduling:
            self.metrics.by_priority(self.table.running, self.table.waiting, self.applier.first_tokens)
        self.summary.tick(running, waiting, c.prompt, c.prefill_cached, c.decode,
                          kv.pool_size - kv.slots.num_free - kv.evictable, kv.pool_size)

    def _shutdown(self) -> None:
        log.info("scheduler_stop", running=len(self.table.running), waiting=len(self.table.waiting))
        kv = self.engine.kv if self.engine is not None else None
        for r in list(self.table.live()):
            self.table.finish(r, FinishReason.ABORT, kv)
        self.table.flush()
        if self.grammar is not None:
            self.grammar.close()
        if self.engine is not None and self.engine.hicache is not None:  # every host copy due on disk: written
            self.engine.hicache.flush(self.worker.send, None, all_writes=True)  # before the worker stops
        self.worker.send(Shutdown())
        self.kv_events.close()
        self.metrics.close()
        self.tracer.shutdown()
        time.sleep(0.1)
        self.ctx.destroy(linger=0)


__all__ = ["Scheduler", "Status"]
