"""The scheduler process: owns every request's metadata and the KV slot bookkeeping, runs
continuous batching, and talks to tokenizer replicas (ROUTER) and worker rank 0 (DEALER)."""

from __future__ import annotations

import signal
import time
from collections import deque

import zmq

from shared.config import SchedulerConfig
from shared.logging import get_logger, stage
from shared.messages.codec import Codec
from shared.messages.common import from_i32
from shared.messages.to_scheduler import (AbortReq, GenerateReq, LoadReq, StepOutput, ToScheduler,
                                          TokenizerHello, WorkerError, WorkerReady)
from shared.messages.to_tokenizer import Load, ModelInfo, ToTokenizer, TokenOut, TokenOutBatch
from shared.messages.to_worker import Shutdown, ToWorker, WorkerSetup
from shared.transport import DealerQueue, RouterQueue
from services.scheduler.batcher import Batcher, Scheduled
from services.scheduler.memory import RowAllocator, SlotAllocator
from services.scheduler.request import Req, Status

log = get_logger("scheduler")


class Scheduler:
    def __init__(self, cfg: SchedulerConfig) -> None:
        self.cfg = cfg
        self.ctx = zmq.Context()
        inbox: Codec = Codec(ToScheduler)
        self.tok = RouterQueue(self.ctx, cfg.tokenizer_endpoint, inbox, Codec(ToTokenizer))
        self.worker = DealerQueue(self.ctx, cfg.worker_endpoint, inbox, Codec(ToWorker), bind=True)
        self.poller = zmq.Poller()
        self.poller.register(self.tok.sock, zmq.POLLIN)
        self.poller.register(self.worker.sock, zmq.POLLIN)
        self.info: ModelInfo | None = None
        self.hellos: list[bytes] = []  # replicas waiting for ModelInfo
        self.reqs: dict[str, Req] = {}
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.outbox: dict[bytes, list[TokenOut]] = {}
        self.computed_tokens = 0
        self.stopping = False
        self.slots: SlotAllocator
        self.batcher: Batcher

    # ---- main loop -------------------------------------------------------------------------
    def run(self) -> None:
        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "stopping", True))
        signal.signal(signal.SIGINT, lambda *_: setattr(self, "stopping", True))
        log.info("scheduler_start", tokenizer_endpoint=self.cfg.tokenizer_endpoint,
                 worker_endpoint=self.cfg.worker_endpoint)
        while not self.stopping:
            busy = bool(self.waiting or self.running)
            self._poll(0 if busy else 100)
            if self.info is None:
                continue
            sched = self.batcher.build(self.running, self.waiting)
            if sched is None:
                if not busy:
                    self.check_integrity()
                continue
            self.worker.send(sched.msg)
            out = self._await_step(sched.step)
            if isinstance(out, StepOutput):
                self._process(sched, out)
            else:
                log.error("worker_step_failed", step=sched.step, error=out.message)
                for r in sched.reqs:
                    if r.status is Status.RUNNING:
                        self._finish(r, "error", error=f"worker failed: {out.message}", code="internal")
            self._apply_aborts()
            self._flush()
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

    def _await_step(self, step: int) -> StepOutput | WorkerError:
        """Wait for the worker's answer to ``step`` while serving tokenizer messages."""
        while True:
            events = dict(self.poller.poll(1000))
            if self.tok.sock in events:
                while (item := self.tok.recv_nowait()) is not None:
                    self._on_tokenizer(*item)
            if self.worker.sock not in events:
                continue
            msg = self.worker.recv_nowait()
            if isinstance(msg, (StepOutput, WorkerError)) and msg.step == step:
                return msg
            if msg is not None:
                self._on_worker(msg)

    # ---- inputs ----------------------------------------------------------------------------
    def _on_tokenizer(self, ident: bytes, msg) -> None:
        if isinstance(msg, GenerateReq):
            self._on_generate(ident, msg)
        elif isinstance(msg, AbortReq):
            r = self.reqs.get(msg.rid)
            if r is not None and r.replica == ident:
                r.aborted = msg.reason
                if r.status is Status.WAITING:
                    self.waiting.remove(r)
                    self._finish(r, msg.reason)
        elif isinstance(msg, TokenizerHello):
            log.info("tokenizer_connected", replica=msg.replica)
            if self.info is not None:
                self.tok.send(ident, self.info)
            else:
                self.hellos.append(ident)
        elif isinstance(msg, LoadReq):
            self.tok.send(ident, self._load(msg.token))

    def _on_generate(self, ident: bytes, msg: GenerateReq) -> None:
        stage("queued", msg.rid, prompt_tokens=len(msg.input_ids), traceparent=msg.traceparent)
        err = self._reject_reason(msg)
        if err:
            code, text = err
            self._emit(ident, TokenOut(rid=msg.rid, finish="error", error=text, error_code=code))
            self._flush()
            return
        r = Req(rid=msg.rid, replica=ident, prompt=list(msg.input_ids), params=msg.params,
                traceparent=msg.traceparent)
        self.reqs[r.rid] = r
        self.waiting.append(r)

    def _reject_reason(self, msg: GenerateReq) -> tuple[str, str] | None:
        if self.info is None:
            return "unavailable", "the model is not loaded yet"
        if msg.rid in self.reqs:
            return "already_exists", f"request_id {msg.rid!r} is already in flight"
        need = len(msg.input_ids) + msg.params.max_new_tokens
        if need > self.info.pool_size:
            return "invalid_argument", (f"prompt ({len(msg.input_ids)}) + max_tokens "
                                        f"({msg.params.max_new_tokens}) exceeds the KV pool ({self.info.pool_size} tokens)")
        if any(t < 0 or t >= self.info.vocab_size for t in msg.input_ids):
            return "invalid_argument", f"token ids must be in [0, {self.info.vocab_size})"
        return None

    def _on_worker(self, msg) -> None:
        if isinstance(msg, WorkerReady):
            self._on_ready(msg)
        else:
            log.warning("unexpected_worker_message", kind=type(msg).__name__)

    def _on_ready(self, w: WorkerReady) -> None:
        self.slots = SlotAllocator(w.pool_size)
        self.batcher = Batcher(self.slots, RowAllocator(self.cfg.max_running_requests),
                               self.cfg.max_running_requests, self.cfg.max_prefill_tokens)
        self.worker.send(WorkerSetup(max_running_requests=self.cfg.max_running_requests))
        self.info = ModelInfo(model=w.model, architecture=w.architecture, vocab_size=w.vocab_size,
                              context_length=w.context_length, pool_size=w.pool_size,
                              max_running_requests=self.cfg.max_running_requests,
                              eos_token_ids=w.eos_token_ids, device=w.device, dtype=w.dtype)
        log.info("worker_ready", **{k: getattr(w, k) for k in w.__struct_fields__})
        for ident in self.hellos:
            self.tok.send(ident, self.info)
        self.hellos.clear()

    # ---- outputs ---------------------------------------------------------------------------
    def _process(self, sched: Scheduled, out: StepOutput) -> None:
        self.computed_tokens += sched.num_tokens
        next_ids = from_i32(out.next_ids)
        assert self.info is not None
        for r, sample, tok in zip(sched.reqs, sched.sample, next_ids.tolist()):
            if not sample or r.status is not Status.RUNNING:
                continue
            r.output.append(tok)
            r.unsent += 1
            if len(r.output) == 1:
                stage("first_token", r.rid, ttft_ms=round(r.wait_ms(), 3))
            reason = r.check_finished(self.info.context_length)
            if reason:
                self._finish(r, reason)
            else:
                self._emit(r.replica, TokenOut(rid=r.rid, token_ids=r.output[len(r.output) - r.unsent:]))
                r.unsent = 0

    def _apply_aborts(self) -> None:
        for r in [r for r in self.running if r.aborted]:
            self._finish(r, r.aborted)

    def _finish(self, r: Req, reason: str, error: str = "", code: str = "") -> None:
        if r.status is Status.RUNNING:
            self.running.remove(r)
            self.slots.free(r.slots)
            self.batcher.rows.free(r.row)
            self.batcher.released_rows.append(r.row)
            r.slots = []
        r.status, r.finish = Status.FINISHED, reason
        self.reqs.pop(r.rid, None)
        new = r.output[len(r.output) - r.unsent:] if r.unsent else []
        self._emit(r.replica, TokenOut(rid=r.rid, token_ids=new, finish=reason, error=error, error_code=code,
                                       prompt_tokens=len(r.prompt), cached_tokens=r.cached_tokens,
                                       completion_tokens=len(r.output)))
        stage("finished", r.rid, finish_reason=reason, completion_tokens=len(r.output),
              e2e_ms=round(r.wait_ms(), 3))

    def _emit(self, ident: bytes, out: TokenOut) -> None:
        self.outbox.setdefault(ident, []).append(out)

    def _flush(self) -> None:
        for ident, outs in self.outbox.items():
            self.tok.send(ident, TokenOutBatch(outs=outs))
        self.outbox.clear()

    def _load(self, token: str) -> Load:
        pool = self.info.pool_size if self.info else 0
        free = self.slots.num_free if self.info else 0
        return Load(token=token, num_running=len(self.running), num_waiting=len(self.waiting),
                    kv_free=free, kv_used=pool - free, kv_pool=pool,
                    steps=self.batcher.step if self.info else 0, computed_tokens=self.computed_tokens)

    def check_integrity(self) -> None:
        self.slots.check_integrity(sum(r.num_computed for r in self.running))

    def _shutdown(self) -> None:
        log.info("scheduler_stop", running=len(self.running), waiting=len(self.waiting))
        for r in list(self.waiting) + list(self.running):
            if r in self.waiting:
                self.waiting.remove(r)
            self._finish(r, "abort")
        self._flush()
        self.worker.send(Shutdown())
        time.sleep(0.1)
        self.ctx.destroy(linger=0)
