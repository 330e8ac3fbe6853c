"""The worker process loop. Rank 0 connects to the scheduler, announces the model and executes
batches, relaying each message to the other tensor-parallel ranks first; those execute the same
steps and answer nobody."""

from __future__ import annotations

import os
import signal
import time

import torch.distributed as dist
import zmq

from shared.config import WorkerConfig
from shared.logging import get_logger
from shared.messages.codec import Codec
from shared.messages.common import i32
from shared.messages.to_scheduler import StepOutput, ToScheduler, WorkerError, WorkerReady
from shared.messages.to_worker import ForwardBatch, Shutdown, ToWorker, WorkerSetup
from shared.tracing import make_tracer
from shared.transport import DealerQueue
from services.worker.metrics import WorkerMetrics
from services.worker.runner import ModelRunner, resolve_device
from services.worker.tp import Relay, init_tp

log = get_logger("worker")


def serve(cfg: WorkerConfig, model_dir: str, model_name: str) -> None:
    cuda = resolve_device(cfg.device, cfg.tp_rank).type == "cuda"
    if cfg.tp_rank != 0:  # followers stop when rank 0 relays Shutdown (or are killed)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    tp, relay = init_tp(cfg, cuda)
    tracer = make_tracer("worker", cfg.otlp_endpoint if tp.rank == 0 else "")  # one span per request: rank 0's
    try:
        runner = ModelRunner(cfg, model_dir, tp, tracer)
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
    stopping = False

    def _stop(*_):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    metrics = WorkerMetrics()
    metrics.serve(cfg.metrics_port)
    spec = runner.spec
    q.send(WorkerReady(model=model_name, architecture=spec.architecture, vocab_size=spec.vocab_size,
                       context_length=runner.context_length, pool_size=runner.pool_size,
                       eos_token_ids=list(spec.eos_token_ids), device=str(runner.device),
                       dtype=str(runner.dtype).removeprefix("torch.")))
    log.info("worker_ready", pid=os.getpid(), tp_size=runner.tp.size)
    msg: ToWorker | None = None
    while not stopping:
        msg = q.recv(timeout_ms=200)
        if msg is None:
            if relay is not None:
                relay.heartbeat()
            continue
        if relay is not None:
            relay.send(msg)
        if isinstance(msg, ForwardBatch):
            t0 = time.perf_counter()
            try:
                next_ids, extra = runner.step(msg)
            except Exception as e:  # one bad batch fails its requests, never the process
                log.exception("batch_failed", step=msg.step)
                q.send(WorkerError(step=msg.step, message=f"{type(e).__name__}: {e}"))
                metrics.failures.inc()
                continue
            seconds = time.perf_counter() - t0
            q.send(StepOutput(step=msg.step, next_ids=i32(next_ids), forward_ms=seconds * 1e3, **extra))
            metrics.step(seconds, len(msg.rows) // 4, len(msg.input_ids) // 4)
        elif isinstance(msg, WorkerSetup):
            runner.setup(msg.max_running_requests)
        elif isinstance(msg, Shutdown):
            break
    if relay is not None and not isinstance(msg, Shutdown):
        relay.send(Shutdown())
    log.info("worker_stop")
    runner.end_spans()
    metrics.close()
    ctx.destroy(linger=0)


def _follow(runner: ModelRunner, relay: Relay) -> None:
    log.info("worker_follower_ready", pid=os.getpid(), tp_rank=runner.tp.rank)
    while True:
        msg = relay.recv()
        if isinstance(msg, ForwardBatch):
            try:
                runner.step(msg)
            except Exception:  # the same batch fails on rank 0, which reports it
                log.exception("batch_failed", step=msg.step)
        elif isinstance(msg, WorkerSetup):
            runner.setup(msg.max_running_requests)
        elif isinstance(msg, Shutdown):
            break
    log.info("worker_stop", tp_rank=runner.tp.rank)
