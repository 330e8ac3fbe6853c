"""The worker process loop. Rank 0 connects to the scheduler, announces the model and executes
batches, relaying each message to the other tensor-parallel ranks first; those execute the same
steps and answer nobody."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

import torch.distributed as dist
import zmq

from shared.config import WorkerConfig
from shared.gc_pause import freeze_heap
from shared.logging import get_logger
from shared.messages.codec import Codec
from shared.messages.common import f32, i32
from shared.messages.to_scheduler import CacheAck, StepOutput, ToScheduler, WorkerError, WorkerReady
from shared.messages.to_worker import CacheOps, ForwardBatch, Shutdown, StepMask, ToWorker, WorkerSetup
from shared.tracing import make_tracer
from shared.transport import DealerQueue, PeerMonitor
from services.worker.metrics import WorkerMetrics
from services.worker.runner import Launched, ModelRunner, resolve_device
from services.worker.step_trace import StepTrace
from services.worker.tp import Relay, init_tp

log = get_logger("worker")
DISK_DRAIN_S = 8.0  # at shutdown, disk writes still queued get this long to finish


def serve(cfg: WorkerConfig, model_dir: str, model_name: str) -> None:
    cuda = resolve_device(cfg.device, cfg.tp_rank).type == "cuda"
    if cfg.tp_rank != 0:  # followers stop when rank 0 relays Shutdown (or are killed)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    tp, relay = init_tp(cfg, cuda)
    tracer = make_tracer("worker", cfg.otlp_endpoint if tp.rank == 0 else "")  # one span per request: rank 0's
    try:
        runner = ModelRunner(cfg, model_dir, tp, tracer)
        freeze_heap()  # torch, the model's modules, the graphs: out of the collector's walk (shared/gc_pause.py)
        if tp.rank == 0:
            _lead(cfg, runner, relay, model_name)
        else:
            assert relay is not None
            _follow(runner, relay)
    finally:
        tracer.shutdown()
        if tp.size > 1:
            dist.destroy_process_group()


def _lead(cfg: WorkerConfig, runner: ModelRunner, relay: Relay | None, model_name: str) -> None:
    ctx = zmq.Context()
    q: DealerQueue = DealerQueue(ctx, cfg.scheduler_endpoint, Codec(ToWorker), Codec(ToScheduler))
    link = PeerMonitor(q.sock)  # a dropped connection: the scheduler counts this worker lost
    stopping = orphaned = False

    def _stop(*_):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    metrics = WorkerMetrics()
    metrics.model(runner.pool_size, runner.kv.bytes_per_token, runner.kv_cache_dtype, runner.weight_bytes,
                  runner.quantization)
    metrics.serve(cfg.metrics_port)
    spec, t = runner.spec, runner.tiers
    tiers = dict(host_pool_size=t.host_slots, kv_bytes_per_token=runner.kv.bytes_per_token,
                 disk_capacity=t.disk_capacity, disk_files=t.files, disk_next_file=t.next_file) if t else {}
    q.send(WorkerReady(model=model_name, architecture=spec.architecture, vocab_size=spec.vocab_size,
                       context_length=runner.context_length, pool_size=runner.pool_size,
                       eos_token_ids=list(spec.eos_token_ids), device=str(runner.device),
                       dtype=str(runner.dtype).removeprefix("torch."),
                       cuda_graph_max_bs=runner.graphs.max_bs if runner.graphs is not None else 0,
                       kv_cache_dtype=runner.kv_cache_dtype, quantization=runner.quantization, **tiers))
    log.info("worker_ready", pid=os.getpid(), tp_size=runner.tp.size)
    copier = t.copier if t is not None else None

    def cache_ops(m: CacheOps) -> None:
        if relay is not None:
            relay.send(m)
        copier.submit(m)

    steps = _Steps(runner, q, metrics, link, cache_ops if copier is not None else None)
    msg: ToWorker | None = None
    while not stopping:
        # a step in flight: look for the next batch without blocking, answer as soon as it is done; tier
        # copies in flight: look often enough to acknowledge them soon after they end
        msg = q.recv(timeout_ms=0 if steps.inflight is not None else 1 if copier and copier.pending else 200)
        if copier is not None:
            _acknowledge(copier, q)
        if msg is None:
            if steps.inflight is not None:
                steps.answer_if_ready()  # (else spin: the next batch or the step's end, whichever first)
            elif orphaned := _scheduler_gone(link):
                break
            elif relay is not None:
                relay.heartbeat()
            continue
        if isinstance(msg, CacheOps) and copier is not None:
            cache_ops(msg)
            _acknowledge(copier, q)  # (on the CPU the copies are done already)
            continue
        if relay is not None and not isinstance(msg, StepMask):
            relay.send(msg)
        if isinstance(msg, ForwardBatch):
            steps.run(msg)
        elif isinstance(msg, WorkerSetup):
            runner.setup(msg.max_running_requests)
        elif isinstance(msg, Shutdown):
            break
    if steps.inflight is not None:
        steps.answer()
    if relay is not None and not isinstance(msg, Shutdown):
        relay.send(Shutdown())
    log.info("worker_stop")
    _ignore_sigterm()
    if copier is not None:
        copier.close(DISK_DRAIN_S)
    runner.end_spans()
    steps.trace.close()
    metrics.close()
    ctx.destroy(linger=0)
    if orphaned:  # exit non-zero: a supervisor starts a fresh worker, which announces itself
        raise SystemExit(1)


def _acknowledge(copier, q: DealerQueue) -> None:
    done, failed = copier.poll()
    if done or failed:
        q.send(CacheAck(done=i32([i for i, _ in done]), seconds=f32([s for _, s in done]),
                        failed=i32([i for i, _ in failed]), reasons=[r for _, r in failed]))


def _scheduler_gone(link: PeerMonitor) -> bool:
    """The connection to the scheduler dropped once (it exited, or dropped this worker for missing
    heartbeats): the scheduler has written this worker's state off, so it must not serve on."""
    link.update()
    if link.disconnects:
        log.error("scheduler_connection_lost", pid=os.getpid())
    return link.disconnects > 0


class _Steps:
    """Rank 0's steps, one queued behind the other: step N+1 is launched before step N's results
    are sent, so the device never waits for the host between them (overlap scheduling). A step
    whose grammar bitmask is deferred is sampled once its ``StepMask`` arrives — after step N's
    results went out, since the scheduler needs them to fill it."""

    def __init__(self, runner: ModelRunner, q: DealerQueue, metrics: WorkerMetrics, link: PeerMonitor,
                 cache_ops: Callable[[CacheOps], None] | None = None) -> None:
        self.runner, self.q, self.metrics, self.link = runner, q, metrics, link
        self.cache_ops = cache_ops
        self.inflight: Launched | None = None
        self._t0 = 0.0
        self._answered: dict[int, float] = {}  # step id -> when its answer went out (the last few)
        self.trace = StepTrace()  # (``BANYAN_STEP_TRACE``: a line a step; off by default)
        # An eager step takes long to queue (a 1,024-row shared-prefix step: tens of ms of Python):
        # the step in flight is answered as soon as it is done, between the layers being queued, so
        # the scheduler builds the next batch meanwhile instead of after this launch.
        runner.between_layers = self.answer_if_ready

    def answer_if_ready(self) -> None:
        if self.inflight is not None and self.inflight.ready():
            self.answer()

    def run(self, b: ForwardBatch) -> None:
        t0 = time.perf_counter()
        try:
            launched = self.runner.launch(b)
        except Exception as e:  # one bad batch fails its requests, never the process
            self._failed(b.step_id, e)
            return
        t1 = time.perf_counter()
        self.metrics.step_host.labels(launched.kind).observe(t1 - t0)
        self.trace.queued(b.step_id, t0, t1)
        if b.follows and (answered := self._answered.get(b.step_id - 2)) is not None:
            self.metrics.step_turnaround.labels(launched.kind).observe(t0 - answered)
        if launched.awaits_mask:
            if self.inflight is not None:
                self.answer()
            t_wait = time.perf_counter()
            mask = self._wait_mask(b.step_id)
            if mask is None:
                return
            self.metrics.mask_wait.observe(time.perf_counter() - t_wait)
            self.metrics.mask_fill.observe(mask.fill_ms / 1e3)
            try:
                self.runner.sample(launched, mask.bitmask)
            except Exception as e:
                self._failed(b.step_id, e)
                return
        elif self.inflight is not None:
            self.answer()
        if b.mask_fill_ms:
            self.metrics.mask_fill.observe(b.mask_fill_ms / 1e3)
        self.inflight, self._t0 = launched, t0

    def answer(self) -> None:
        """Wait for the step in flight and send its results."""
        launched, self.inflight = self.inflight, None
        b = launched.batch
        try:
            next_ids, extra = self.runner.finish(launched)
        except Exception as e:
            self._failed(b.step_id, e)
            return
        seconds = time.perf_counter() - self._t0
        self.q.send(StepOutput(step_id=b.step_id, next_ids=i32(next_ids), forward_ms=seconds * 1e3,
                               busy_ms=self.runner.busy_s * 1e3, **extra))
        self._answered[b.step_id] = time.perf_counter()
        self._answered.pop(b.step_id - 4, None)
        self.metrics.step(seconds, len(b.rows) // 4, len(b.input_ids) // 4, self.runner.busy_s, self.runner.idle_s,
                          cascade=bool(b.cascade_group), kind=launched.kind)
        self.trace.answered(b.step_id, launched.kind, len(b.rows) // 4, len(b.input_ids) // 4, self.runner.busy_s,
                            self.runner.idle_s)

    def _wait_mask(self, step: int) -> StepMask | None:
        while True:
            msg = self.q.recv(timeout_ms=1000)
            if isinstance(msg, StepMask) and msg.step_id == step:
                return msg
            if isinstance(msg, Shutdown):
                log.warning("shutdown_while_waiting_for_mask", step=step)
                return None
            if isinstance(msg, CacheOps) and self.cache_ops is not None:
                self.cache_ops(msg)
                continue
            if msg is None and _scheduler_gone(self.link):
                return None
            if msg is not None:
                log.warning("unexpected_message_while_waiting_for_mask", step=step, kind=type(msg).__name__)

    def _failed(self, step: int, e: Exception) -> None:
        log.exception("batch_failed", step=step)
        if self.inflight is not None:  # answers go out in step order
            self.answer()
        self.q.send(WorkerError(step_id=step, message=f"{type(e).__name__}: {e}"))
        self.metrics.failures.inc()


def _follow(runner: ModelRunner, relay: Relay) -> None:
    log.info("worker_follower_ready", pid=os.getpid(), tp_rank=runner.tp.rank)
    while True:
        msg = relay.recv()
        if isinstance(msg, ForwardBatch):
            try:
                runner.run_batch(msg)  # (followers never wait for a mask: rank 0 alone samples)
            except Exception:  # the same batch fails on rank 0, which reports it
                log.exception("batch_failed", step=msg.step_id)
        elif isinstance(msg, WorkerSetup):
            runner.setup(msg.max_running_requests)
        elif isinstance(msg, CacheOps) and runner.tiers is not None:
            runner.tiers.copier.submit(msg)
        elif isinstance(msg, Shutdown):
            break
        if runner.tiers is not None:
            runner.tiers.copier.poll()  # (rank 0 acknowledges; this rank only forgets what ended)
    log.info("worker_stop", tp_rank=runner.tp.rank)
    _ignore_sigterm()
    if runner.tiers is not None:
        runner.tiers.copier.close(DISK_DRAIN_S)


def _ignore_sigterm() -> None:
    """Stopping already (the scheduler's Shutdown): a SIGTERM now — the launcher stops workers last
    and may signal one that is tearing down — must not kill it half-way (exit code -15)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
