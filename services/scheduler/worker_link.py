"""The scheduler's link to worker rank 0, how it notices that the worker is gone, and what the
scheduler does then and when a (restarted) worker is ready (split out of scheduler.py).

The worker is *attached* from its ``WorkerReady`` until it is lost. It is lost when
- its connection closes: the process exited, crashed or was killed (ZMQ monitor event, at once);
- its connection misses ZMTP heartbeats for ``timeout_s`` (host down, network cut, process
  frozen): libzmq drops it, which reads the same;
- a message to it cannot be queued because no worker is connected.
The connection count is looked at on every wake-up of the loop (at least once a second while a
step is awaited), so a missed event cannot leave the loop waiting for an answer that will never
come. A worker that stays connected but has not answered a step for ``timeout_s`` is only logged
(``worker_slow``): its libzmq still answers heartbeats, so the process is alive and may be running
a long step; telling a hang from that is its supervisor's job.

On loss the scheduler fails every request with UNAVAILABLE, drops its KV bookkeeping (the KV died
with the worker) and tells the tokenizers (``EngineStatus``); a worker that connects and sends
``WorkerReady`` is attached as a fresh one.
"""

from __future__ import annotations

import gc
import time
from typing import TYPE_CHECKING

import zmq

from shared.logging import get_logger
from shared.messages.codec import Codec
from shared.messages.to_scheduler import WorkerReady
from shared.messages.to_tokenizer import EngineStatus, ModelInfo
from shared.messages.to_worker import ToWorker, WorkerSetup
from shared.model_path import resolve_model
from shared.transport import DealerQueue, PeerMonitor
from services.scheduler.batcher import Batcher, Limits
from services.scheduler.cascade import CascadePolicy
from services.scheduler.grammar import GrammarBackend
from services.scheduler.kv import KVManager
from services.scheduler.policy import POLICIES

if TYPE_CHECKING:
    from services.scheduler.scheduler import Scheduler

log = get_logger("scheduler")
HEARTBEAT_IVL_MS = 1000
EXITED = "the worker process exited or was cut off (its connection to the scheduler closed)"
UNREACHABLE = "the worker is not connected (a message to it could not be sent)"


class WorkerLink:
    """The bound DEALER to worker rank 0 (``send`` / ``recv_nowait`` / ``sock``), its connection
    monitor (``monitor.sock``: poll it with the others) and the attached worker's liveness."""

    def __init__(self, ctx: zmq.Context, endpoint: str, inbox: Codec, timeout_s: float) -> None:
        ms = int(timeout_s * 1000)
        self.q: DealerQueue = DealerQueue(ctx, endpoint, inbox, Codec(ToWorker), bind=True, options={
            zmq.HEARTBEAT_IVL: min(HEARTBEAT_IVL_MS, ms), zmq.HEARTBEAT_TIMEOUT: ms})
        self.sock = self.q.sock
        self.monitor = PeerMonitor(self.sock)
        self.timeout_s = timeout_s
        self.attached = False
        self.losses = 0  # workers lost so far (a wait for an answer ends when it changes)
        self._fd: int | None = None  # the attached worker's connection (None: several were open)
        self._closed = self._unsent = False
        self._warned = 0.0

    def attach(self) -> None:
        """A worker sent ``WorkerReady`` (its connection was accepted before: that event is in)."""
        self._look()
        fds = self.monitor.fds
        self._fd = next(iter(fds)) if len(fds) == 1 else None
        self.attached, self._closed, self._unsent = True, False, False

    def detach(self) -> None:
        """The attached worker is lost."""
        self.attached = False
        self.losses += 1

    def send(self, msg) -> None:
        """Queue ``msg`` for the worker; never blocks (a bound DEALER without a peer would)."""
        if not self.attached:
            return  # (lost: what it would have been told is moot)
        try:
            self.q.send(msg, zmq.NOBLOCK)
        except zmq.Again:
            self._unsent = True

    def recv_nowait(self):
        return self.q.recv_nowait()

    def _look(self) -> None:
        for event, fd in self.monitor.update():
            if event == zmq.EVENT_DISCONNECTED and self.attached and fd == self._fd:
                self._closed = True

    def lost(self, step: int = -1, since: float = 0.0) -> str:
        """Why the attached worker is lost ("" while it is not, or none is attached): call on
        every wake-up; ``step`` / ``since``: the step awaited and since when (a slow one is logged)."""
        self._look()
        if not self.attached:
            return ""
        if self._closed or not self.monitor.fds:
            return EXITED
        if self._unsent:
            return UNREACHABLE
        now = time.monotonic()
        if since and now - since > self.timeout_s and now - self._warned > self.timeout_s:
            self._warned = now
            log.warning("worker_slow", step=step, waited_s=round(now - since, 1), connections=len(self.monitor.fds))
        return ""


def worker_ready(s: Scheduler, w: WorkerReady) -> None:
    """A worker is ready — at start, or a restarted one: fresh KV bookkeeping sized from its pool,
    ``WorkerSetup`` down, ``ModelInfo`` to every replica (serving again)."""
    cfg = s.cfg
    if s.worker.attached:  # a new worker while the old one looked alive: the old one's state is gone
        worker_lost(s, "the worker process restarted")
    old = getattr(s, "grammar", None)
    # step numbers go on (a late answer is never taken), and so do the counters GetLoad / metrics report
    b = s.batcher if old is not None else None
    carried = (b.step, b.retractions, b.cascade_steps, b.cascade_saved, s.kv.evicted_tokens) if b else (0,) * 5
    s.kv = KVManager(w.pool_size, cfg.max_running_requests, cfg.page_size, not cfg.disable_radix_cache)
    s.batcher = Batcher(s.kv, POLICIES[cfg.schedule_policy](),
                        Limits(cfg.max_running_requests, cfg.max_prefill_tokens, cfg.chunked_prefill_size),
                        None if cfg.disable_cascade_attention else
                        CascadePolicy(cfg.cascade_min_group, cfg.cascade_min_prefix, cfg.cascade_min_saved))
    b = s.batcher
    b.step, b.retractions, b.cascade_steps, b.cascade_saved, s.kv.evicted_tokens = carried
    s.worker.attach()
    s.worker.send(WorkerSetup(max_running_requests=cfg.max_running_requests))
    s.info = ModelInfo(model=w.model, architecture=w.architecture, vocab_size=w.vocab_size,
                       context_length=w.context_length, pool_size=s.kv.pool_size,
                       max_running_requests=cfg.max_running_requests,
                       eos_token_ids=w.eos_token_ids, device=w.device, dtype=w.dtype)
    log.info("worker_ready", restarted=old is not None, **{k: getattr(w, k) for k in w.__struct_fields__})
    if old is None or (old.vocab_size, old.stop_ids) != (w.vocab_size, list(w.eos_token_ids)):
        if old is not None:
            old.close()
        s.grammar = GrammarBackend(resolve_model(cfg.model)[0], w.vocab_size, w.eos_token_ids)
        s.grammar.wait_ready()  # before serving: building it later would contend with the loop
        # the start-up heap (torch, transformers, xgrammar, the vocabulary) lives as long as the process:
        # out of the collector's sight, a full collection no longer walks it (ms per step, under load)
        gc.collect()
        gc.freeze()
    s.down = ""
    for ident in s.replicas:
        s.tok.send(ident, s.info)


def worker_lost(s: Scheduler, reason: str) -> None:
    """Fail every request (waiting, compiling, running) with UNAVAILABLE, forget the step in flight
    and the KV bookkeeping (the KV died with the worker), tell every replica the engine is not
    serving; new requests are refused with ``reason`` until the next ``WorkerReady``."""
    s.worker.detach()
    live = s._live()
    log.error("worker_lost", reason=reason, requests=len(live), running=len(s.running), waiting=len(s.waiting))
    for r in live:
        s._finish(r, "error", error=f"{reason}: the request was lost, retry it", code="unavailable")
    s.info, s.down, s.inflight = None, reason, None
    s.waiting.clear()
    s.running.clear()
    s.answers.clear()
    s.aborts.clear()
    s.grammar.pending.clear()  # (their requests failed; a compile still running finishes unseen)
    s._flush()
    for ident in s.replicas:
        s.tok.send(ident, EngineStatus(serving=False, reason=reason))
