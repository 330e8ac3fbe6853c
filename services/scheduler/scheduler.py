"""The scheduler process: owns every request's metadata and the KV bookkeeping, runs continuous
batching, and talks to tokenizer replicas (ROUTER) and worker rank 0 (DEALER, ``worker_link.py``:
a lost worker fails every request with UNAVAILABLE until a new one is ready)."""

from __future__ import annotations

import signal
import time
from collections import deque

import msgspec
import zmq

from shared.config import SchedulerConfig
from shared.logging import get_logger, stage
from shared.messages.codec import Codec
from shared.messages.to_scheduler import (AbortReq, GenerateReq, LoadReq, StepOutput, ToScheduler,
                                          TokenizerHello, WorkerError, WorkerReady)
from shared.messages.to_tokenizer import Load, ModelInfo, ToTokenizer, TokenOut, TokenOutBatch
from shared.messages.to_worker import Shutdown
from shared.transport import RouterQueue
from shared.tracing import ensure, make_tracer
from services.scheduler.batcher import Batcher, Scheduled
from services.scheduler.grammar import GrammarBackend
from services.scheduler.kv import KVManager
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.request import Req, Status
from services.scheduler.outputs import process_step, send_mask
from services.scheduler.step_io import token_out, with_extras
from services.scheduler.worker_link import WorkerLink, worker_lost, worker_ready

log = get_logger("scheduler")


class Counters(msgspec.Struct):
    prefill_computed: int = 0
    prefill_cached: int = 0
    decode: int = 0
    prompt: int = 0  # prompt tokens of the branches prefilled (prefill_cached of them came from the cache)


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
        self.info: ModelInfo | None = None  # None: not serving (no worker ready yet, or it was lost)
        self.down = ""  # why not serving, once a worker was lost
        self.replicas: set[bytes] = set()  # tokenizer replicas that said hello
        self.groups: dict[str, list[Req]] = {}  # rid → its branches (n > 1)
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.outbox: dict[bytes, list[TokenOut]] = {}
        self.aborts: list[Req] = []
        self.jump_forward_tokens = 0  # output tokens appended by jump-forward (not sampled)
        self.counters = Counters()
        self.metrics = SchedulerMetrics()
        self.tracer = make_tracer("scheduler", cfg.otlp_endpoint)
        self.stopping = False
        self.inflight: Scheduled | None = None  # overlap: the step the worker runs while the next is built
        self.last_built = False  # the last loop iteration sent a step (the next one ``follows`` it)
        self.answers: dict[int, StepOutput | WorkerError] = {}
        self.kv: KVManager
        self.batcher: Batcher
        self.grammar: GrammarBackend

    # ---- main loop -------------------------------------------------------------------------
    def run(self) -> None:
        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "stopping", True))
        signal.signal(signal.SIGINT, lambda *_: setattr(self, "stopping", True))
        self.loop()

    def loop(self) -> None:
        log.info("scheduler_start", tokenizer_endpoint=self.cfg.tokenizer_endpoint,
                 worker_endpoint=self.cfg.worker_endpoint)
        self.metrics.serve(self.cfg.metrics_port)
        while not self.stopping:
            busy = bool(self.waiting or self.running or self.inflight)
            compiling = self.info is not None and bool(self.grammar.pending)
            self._poll(0 if busy else 5 if compiling else 100)
            if self.info is None:
                continue
            if compiling:
                self._poll_grammars()
            self._apply_aborts()
            self._flush()  # aborts of requests that are not in the next batch end their streams now
            sched = self.batcher.build(self.running, self.waiting)
            if sched is None and self.inflight is None:
                if not busy:
                    self.kv.check_integrity(self.running)
                    self._update_metrics([])
                self.last_built = False
                continue
            if sched is not None:
                # overlap: the step in flight decides what the grammar allows next: its mask follows
                defer = self.inflight is not None
                sched.msg = with_extras(sched, self.grammar, defer_mask=defer, follows=self.last_built)
                self.worker.send(sched.msg)
            self.last_built = sched is not None
            if self.inflight is not None:
                # the next step's deferred mask goes out as soon as the matchers have advanced
                if not self._complete(self.inflight, sched if sched is not None and sched.msg.mask_deferred else None):
                    continue  # the worker was lost: every request failed
            self.inflight = None
            if sched is not None:
                if self.cfg.disable_overlap_schedule:
                    if not self._complete(sched):
                        continue
                else:
                    self.inflight = sched
            self._apply_aborts()
            self._flush()
            self._update_metrics(sched.queue_s if sched is not None else [])
        self._shutdown()

    def _poll(self, timeout_ms: int) -> None:
        """Handle every pending message from tokenizers and the worker."""
        events = dict(self.poller.poll(timeout_ms))
        if self.tok.sock in events:
            self._drain_tokenizers()
        if self.worker.sock in events:
            while (msg := self.worker.recv_nowait()) is not None:
                self._on_worker(msg)
        self._check_worker()

    def _check_worker(self, step: int = -1, since: float = 0.0) -> None:
        reason = self.worker.lost(step, since)
        if reason:
            worker_lost(self, reason)

    def _drain_tokenizers(self) -> None:
        while (item := self.tok.recv_nowait()) is not None:
            self._on_tokenizer(*item)

    def _complete(self, sched: Scheduled, mask_for: Scheduled | None = None) -> bool:
        """Wait for ``sched``'s results and apply them (or fail its requests), sending the deferred
        mask of ``mask_for`` (the step after it) on the way; False: the worker was lost meanwhile
        (every request failed, the step state reset)."""
        out = self._await_step(sched.step)
        if out is None:
            return False
        if isinstance(out, StepOutput):
            process_step(self, sched, out, mask_for)
        else:
            log.error("worker_step_failed", step=sched.step, error=out.message)
            for r, sample in zip(sched.reqs, sched.sample):
                if sample:  # (a retracted request waits for this token: it resumes without it)
                    r.pending -= 1
                    r.discard = min(r.discard, r.pending)
                if r.status is Status.RUNNING:
                    self._finish(r, "error", error=f"worker failed: {out.message}", code="internal")
            send_mask(self, mask_for)
        return True

    def _await_step(self, step: int) -> StepOutput | WorkerError | None:
        """Wait for the worker's answer to ``step`` while serving tokenizer messages (answers come
        in step order; one to a later step is kept for its turn); None when the worker is lost."""
        since, losses = time.monotonic(), self.worker.losses
        while step not in self.answers:
            events = dict(self.poller.poll(1000))
            if self.tok.sock in events:
                self._drain_tokenizers()
            if self.worker.sock in events:
                while (msg := self.worker.recv_nowait()) is not None:
                    self._on_worker(msg)
            if step not in self.answers:
                self._check_worker(step, since)
            if self.worker.losses != losses:
                return None
        return self.answers.pop(step)

    # ---- inputs ----------------------------------------------------------------------------
    def _on_tokenizer(self, ident: bytes, msg) -> None:
        if isinstance(msg, GenerateReq):
            self._on_generate(ident, msg)
        elif isinstance(msg, AbortReq):
            for r in self.groups.get(msg.rid, ()):
                if r.replica == ident and msg.index in (-1, r.index) and r.status is not Status.FINISHED:
                    r.aborted = msg.reason
                    self.aborts.append(r)
        elif isinstance(msg, TokenizerHello):
            log.info("tokenizer_connected", replica=msg.replica)
            self.replicas.add(ident)
            if self.info is not None:  # (else: when the worker is ready)
                self.tok.send(ident, self.info)
        elif isinstance(msg, LoadReq):
            self.tok.send(ident, self._load(msg.token))

    def _on_generate(self, ident: bytes, msg: GenerateReq) -> None:
        traceparent = ensure(msg.traceparent)
        stage("queued", msg.rid, trace_id=traceparent[3:35], prompt_tokens=len(msg.input_ids), n=msg.n)
        err = self._reject_reason(msg)
        if err:
            code, text = err
            for i in range(max(1, msg.n)):
                self._emit(ident, TokenOut(rid=msg.rid, index=i, finish="error", error=text, error_code=code))
            self._flush()
            return
        branches: list[Req] = []
        for i in range(msg.n):
            params = msg.params
            if i and params.seed is not None:
                params = msgspec.structs.replace(params, seed=params.seed + i)
            span = self.tracer.start("schedule", traceparent, request_id=msg.rid, index=i)
            branches.append(Req(rid=msg.rid, replica=ident, prompt=list(msg.input_ids), params=params, index=i,
                                ns=msg.cache_ns, traceparent=span.traceparent, span=span))
        self.groups[msg.rid] = branches
        if msg.constraint is not None:
            self.grammar.submit(branches, msg.constraint)  # joins the queue once compiled
        else:
            self.waiting.extend(branches)

    def _poll_grammars(self) -> None:
        ready, failed = self.grammar.poll()
        times = self.grammar.compile_ms
        if times:
            n = len(times)  # (compile threads append)
            self.metrics.grammar_compiled([ms / 1e3 for ms in times[:n]])
            del times[:n]
        for branches in ready:
            self.waiting.extend(r for r in branches if r.status is Status.WAITING and not r.aborted)
        for branches, error in failed:
            for r in branches:
                self._finish(r, "error", error=error, code="invalid_argument")
        if failed:
            self._flush()

    def _reject_reason(self, msg: GenerateReq) -> tuple[str, str] | None:
        if self.info is None:
            return "unavailable", f"{self.down}: not serving until a worker is ready" if self.down else \
                "the model is not loaded yet"
        if msg.rid in self.groups:
            return "already_exists", f"request_id {msg.rid!r} is already in flight"
        queued = self._num_waiting()
        if self.cfg.max_queued_requests and queued + msg.n > self.cfg.max_queued_requests:
            return "resource_exhausted", (f"the queue is full ({queued} requests waiting, limit "
                                          f"{self.cfg.max_queued_requests}): retry later")
        need = len(msg.input_ids) + msg.params.max_new_tokens
        if need > self.kv.pool_size:
            return "invalid_argument", (f"prompt ({len(msg.input_ids)}) + max_tokens "
                                        f"({msg.params.max_new_tokens}) exceeds the KV pool ({self.kv.pool_size} tokens)")
        if msg.n < 1 or msg.n > self.cfg.max_running_requests:
            return "invalid_argument", f"n must be in [1, {self.cfg.max_running_requests}]"
        if any(t < 0 or t >= self.info.vocab_size for t in msg.input_ids):
            return "invalid_argument", f"token ids must be in [0, {self.info.vocab_size})"
        return None

    def _on_worker(self, msg) -> None:
        if isinstance(msg, (StepOutput, WorkerError)):  # (overlap: it may come while the loop polls)
            if self.worker.attached:
                self.answers[msg.step] = msg
        elif isinstance(msg, WorkerReady):
            worker_ready(self, msg)
        else:
            log.warning("unexpected_worker_message", kind=type(msg).__name__)

    def _live(self) -> list[Req]:
        """Every request not finished: waiting, compiling, running."""
        return [r for branches in self.groups.values() for r in branches if r.status is not Status.FINISHED]

    # ---- outputs ---------------------------------------------------------------------------
    def _apply_aborts(self) -> None:
        """Aborts take effect between steps (a running request may be in the batch in flight)."""
        for r in self.aborts:
            if r.status is Status.WAITING and r in self.waiting:  # (else: its grammar is compiling)
                self.waiting.remove(r)
            if r.status is not Status.FINISHED:
                self._finish(r, r.aborted)
        self.aborts.clear()

    def _finish(self, r: Req, reason: str, error: str = "", code: str = "") -> None:
        self._end(r, reason)
        self._report(r, reason, error, code)

    def _end(self, r: Req, reason: str) -> None:
        """``r`` stops: out of the running set or the queue, its KV released."""
        if r.status is Status.RUNNING:
            self.running.remove(r)
            self.kv.release(r, keep=reason != "error")
        elif r.status is Status.WAITING and r in self.waiting:  # (retracted while its last token was in flight)
            self.waiting.remove(r)
        r.status, r.finish = Status.FINISHED, reason
        group = self.groups.get(r.rid, [])
        if all(b.status is Status.FINISHED for b in group):
            self.groups.pop(r.rid, None)

    def _report(self, r: Req, reason: str, error: str = "", code: str = "") -> None:
        """The final TokenOut, stage line and span of a request that ended."""
        self._emit(r.replica, token_out(r, finish=reason, error=error, error_code=code, prompt_tokens=len(r.prompt),
                                        completion_tokens=len(r.output)))
        stage("finished", r.rid, trace_id=r.trace_id, index=r.index, finish_reason=reason,
              completion_tokens=len(r.output), cached_tokens=r.cached_tokens, e2e_ms=round(r.wait_ms(), 3))
        if r.span is not None:
            r.span.end(finish_reason=reason, prompt_tokens=len(r.prompt), completion_tokens=len(r.output),
                       cached_tokens=r.cached_tokens, retractions=r.retractions)

    def _emit(self, ident: bytes, out: TokenOut) -> None:
        self.outbox.setdefault(ident, []).append(out)

    def _flush(self) -> None:
        for ident, outs in self.outbox.items():
            self.tok.send(ident, TokenOutBatch(outs=outs))
        self.outbox.clear()

    def _update_metrics(self, queue_times: list[float]) -> None:
        c, kv = self.counters, self.kv
        waiting = self._num_waiting()
        self.metrics.step(len(self.running), waiting, kv.pool_size, kv.slots.num_free, kv.evictable,
                          self.batcher.retractions, c.prompt, c.prefill_cached, queue_times,
                          (self.batcher.cascade_steps, self.batcher.cascade_saved))

    def _num_waiting(self) -> int:
        """Requests not running yet: queued, or waiting for their grammar to compile."""
        compiling = sum(len(p.reqs) for p in self.grammar.pending) if self.info is not None else 0
        return len(self.waiting) + compiling

    def _load(self, token: str) -> Load:
        ready = self.info is not None
        pool = self.kv.pool_size if ready else 0
        free = self.kv.slots.num_free if ready else 0
        c = self.counters
        return Load(token=token, num_running=len(self.running), num_waiting=self._num_waiting(), kv_free=free,
                    kv_used=pool - free, kv_pool=pool, kv_evictable=self.kv.evictable if ready else 0,
                    steps=self.batcher.step if ready else 0, prefill_computed_tokens=c.prefill_computed,
                    prefill_cached_tokens=c.prefill_cached, decode_tokens=c.decode,
                    retractions=self.batcher.retractions if ready else 0,
                    evicted_tokens=self.kv.evicted_tokens if ready else 0,
                    jump_forward_tokens=self.jump_forward_tokens)

    def _shutdown(self) -> None:
        log.info("scheduler_stop", running=len(self.running), waiting=len(self.waiting))
        for r in self._live():
            self._finish(r, "abort")
        self._flush()
        if getattr(self, "grammar", None) is not None:
            self.grammar.close()
        self.worker.send(Shutdown())
        self.metrics.close()
        self.tracer.shutdown()
        time.sleep(0.1)
        self.ctx.destroy(linger=0)
