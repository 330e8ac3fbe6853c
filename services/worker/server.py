"""The worker process loop (rank 0): connect to the scheduler, announce the model, execute batches."""

from __future__ import annotations

import os
import signal
import time

import zmq

from shared.config import WorkerConfig
from shared.logging import get_logger
from shared.messages.codec import Codec
from shared.messages.common import i32
from shared.messages.to_scheduler import StepOutput, ToScheduler, WorkerError, WorkerReady
from shared.messages.to_worker import ForwardBatch, Shutdown, ToWorker, WorkerSetup
from shared.transport import DealerQueue
from services.worker.runner import ModelRunner

log = get_logger("worker")


def serve(cfg: WorkerConfig, model_dir: str, model_name: str) -> None:
    runner = ModelRunner(cfg, model_dir)
    ctx = zmq.Context()
    q: DealerQueue = DealerQueue(ctx, cfg.scheduler_endpoint, Codec(ToWorker), Codec(ToScheduler))
    stopping = False

    def _stop(*_):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    spec = runner.spec
    q.send(WorkerReady(model=model_name, architecture=spec.architecture, vocab_size=spec.vocab_size,
                       context_length=runner.context_length, pool_size=runner.pool_size,
                       eos_token_ids=list(spec.eos_token_ids), device=str(runner.device),
                       dtype=str(runner.dtype).removeprefix("torch.")))
    log.info("worker_ready", pid=os.getpid())
    while not stopping:
        msg = q.recv(timeout_ms=200)
        if msg is None:
            continue
        if isinstance(msg, ForwardBatch):
            t0 = time.perf_counter()
            try:
                next_ids = runner.execute(msg)
            except Exception as e:  # one bad batch fails its requests, never the process
                log.exception("batch_failed", step=msg.step)
                q.send(WorkerError(step=msg.step, message=f"{type(e).__name__}: {e}"))
                continue
            q.send(StepOutput(step=msg.step, next_ids=i32(next_ids),
                              forward_ms=(time.perf_counter() - t0) * 1e3))
        elif isinstance(msg, WorkerSetup):
            runner.setup(msg.max_running_requests)
        elif isinstance(msg, Shutdown):
            break
    log.info("worker_stop")
    ctx.destroy(linger=0)
