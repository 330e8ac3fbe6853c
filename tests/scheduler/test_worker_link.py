"""Worker loss without the real processes: the scheduler's link notices a closed or frozen worker
connection; the scheduler loop (in a thread, against a fake worker and a fake tokenizer on ZMQ)
fails every request with UNAVAILABLE, says it is not serving, refuses new requests and serves
again once a new worker is ready; the tokenizer's client turns health off and on; the launcher's
restart budget."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import threading
import time

import pytest
import zmq
import zmq.asyncio

from shared.config import SchedulerConfig
from shared.errors import Unavailable
from shared.messages.codec import Codec
from shared.messages.common import SamplingParams, from_i32, i32
from shared.messages.to_scheduler import GenerateReq, StepOutput, ToScheduler, TokenizerHello, WorkerReady
from shared.messages.to_tokenizer import EngineStatus, ModelInfo, ToTokenizer, TokenOutBatch
from shared.messages.to_worker import ForwardBatch, Shutdown, ToWorker, WorkerSetup
from shared.transport import DealerQueue
from banyan.supervision import RestartBudget, how_it_ended, worker_group
from services.scheduler.scheduler import Scheduler
from services.scheduler.worker_link import EXITED, WorkerLink
from services.tokenizer.scheduler_client import SchedulerClient

WAIT_S = 30.0  # bound on waits for something that must happen (not a timing claim)


def ready_msg(pool_size: int = 1000, vocab_size: int = 2000) -> WorkerReady:
    return WorkerReady(model="m", architecture="A", vocab_size=vocab_size, context_length=512, pool_size=pool_size,
                       eos_token_ids=[1], device="cpu", dtype="float32")


def wait_lost(link: WorkerLink) -> str:
    deadline = time.monotonic() + WAIT_S
    while not (reason := link.lost()):
        assert time.monotonic() < deadline, "the worker was never found lost"
        link.monitor.sock.poll(100)
    return reason


# ---- the link ----------------------------------------------------------------------------------
def test_link_notices_a_closed_connection_and_never_blocks(tmp_path):
    ctx = zmq.Context()
    link = WorkerLink(ctx, f"ipc://{tmp_path}/w.ipc", Codec(ToScheduler), timeout_s=30)
    worker = DealerQueue(ctx, f"ipc://{tmp_path}/w.ipc", Codec(ToWorker), Codec(ToScheduler))
    worker.send(ready_msg())
    assert isinstance(link.q.recv(timeout_ms=int(WAIT_S * 1000)), WorkerReady)
    assert link.lost() == ""  # nothing is attached yet
    link.attach()
    link.send(WorkerSetup(max_running_requests=4))
    assert isinstance(worker.recv(timeout_ms=int(WAIT_S * 1000)), WorkerSetup)
    assert link.lost() == ""
    worker.sock.close(linger=0)
    assert wait_lost(link) == EXITED
    link.detach()
    assert link.losses == 1 and not link.attached
    link.send(WorkerSetup(max_running_requests=4))  # no peer: dropped, not blocking
    link.attach()  # (as if a worker had said ready with no connection open)
    link.send(WorkerSetup(max_running_requests=4))
    assert link.lost() == EXITED
    ctx.destroy(linger=0)


def test_link_drops_a_frozen_worker_by_heartbeat(tmp_path):
    """A worker process that stops (SIGSTOP: like a host that vanished) answers no heartbeat."""
    ctx = zmq.Context()
    ep = f"ipc://{tmp_path}/w.ipc"
    link = WorkerLink(ctx, ep, Codec(ToScheduler), timeout_s=1.0)
    code = (f"import time, zmq; s = zmq.Context().socket(zmq.DEALER); s.connect({ep!r}); s.send(b'x'); "
            "time.sleep(600)")
    peer = subprocess.Popen([sys.executable, "-c", code])
    try:
        assert link.sock.poll(int(WAIT_S * 1000))
        link.sock.recv()
        link.attach()
        assert link.lost() == ""
        peer.send_signal(signal.SIGSTOP)
        assert wait_lost(link) == EXITED
    finally:
        peer.kill()
        peer.wait()
        ctx.destroy(linger=0)


# ---- the scheduler loop against fakes ----------------------------------------------------------
class Fakes:
    """A fake tokenizer (DEALER) and fake workers around a scheduler loop running in a thread."""

    def __init__(self, tmp_path, model: str) -> None:
        self.cfg = SchedulerConfig(model=model, tokenizer_endpoint=f"ipc://{tmp_path}/t.ipc",
                                   worker_endpoint=f"ipc://{tmp_path}/w.ipc", max_running_requests=1)
        self.sched = Scheduler(self.cfg)
        self.thread = threading.Thread(target=self.sched.loop, daemon=True)
        self.thread.start()
        self.ctx = zmq.Context()
        self.tok = DealerQueue(self.ctx, self.cfg.tokenizer_endpoint, Codec(ToTokenizer), Codec(ToScheduler),
                               identity="tok")
        self.tok.send(TokenizerHello(replica="tok"))

    def worker(self, pool_size: int) -> DealerQueue:
        w = DealerQueue(self.ctx, self.cfg.worker_endpoint, Codec(ToWorker), Codec(ToScheduler))
        w.send(ready_msg(pool_size))
        assert isinstance(self.recv(w), WorkerSetup)
        return w

    def recv(self, q: DealerQueue):
        msg = q.recv(timeout_ms=int(WAIT_S * 1000))
        assert msg is not None, "nothing came"
        return msg

    def outs(self, until) -> list:
        """TokenOuts (and other messages) to the tokenizer until ``until(msg)``."""
        got = []
        while True:
            msg = self.recv(self.tok)
            got += msg.outs if isinstance(msg, TokenOutBatch) else [msg]
            if until(got[-1]):
                return got

    def answer(self, w: DealerQueue, token: int = 9) -> ForwardBatch:
        b = self.recv(w)
        assert isinstance(b, ForwardBatch)
        w.send(StepOutput(step_id=b.step_id, next_ids=i32([token] * (len(b.rows) // 4))))
        return b

    def stop(self) -> None:
        self.sched.stopping = True
        self.thread.join(WAIT_S)
        assert not self.thread.is_alive()


def gen(rid: str, max_new: int = 50) -> GenerateReq:
    return GenerateReq(rid=rid, input_ids=[5, 6, 7, 8], params=SamplingParams(temperature=0.0, max_new_tokens=max_new))


def test_scheduler_fails_everything_on_worker_loss_and_serves_a_new_worker(tmp_path, demo_dir):
    f = Fakes(tmp_path, demo_dir)
    try:
        old = f.worker(pool_size=1000)
        info = f.recv(f.tok)
        assert isinstance(info, ModelInfo) and info.pool_size == 1000
        f.tok.send(gen("running"))
        f.tok.send(gen("waiting"))  # max_running_requests=1: it waits
        last = max(f.answer(old).step_id for _ in range(3))
        assert f.outs(lambda o: getattr(o, "token_ids", None))[-1].rid == "running"
        f.recv(old)  # a step the worker never answers: it dies
        old.sock.close(linger=0)
        got = f.outs(lambda o: isinstance(o, EngineStatus))
        ended = {o.rid: o for o in got[:-1] if o.finish}
        assert set(ended) == {"running", "waiting"}
        for o in ended.values():
            assert o.finish == "error" and o.error_code == "unavailable" and "worker process exited" in o.error
        assert got[-1] == EngineStatus(serving=False, reason=EXITED)
        f.tok.send(gen("meanwhile"))  # refused at once, with the reason
        (o,) = f.outs(lambda o: True)
        assert (o.rid, o.finish, o.error_code) == ("meanwhile", "error", "unavailable") and EXITED in o.error

        f.sched.counters.retractions = 7  # (totals reported by GetLoad and the metrics outlive the worker)
        new = f.worker(pool_size=500)  # a restarted worker: a fresh, smaller pool
        info = f.recv(f.tok)
        assert isinstance(info, ModelInfo) and info.pool_size == 500
        f.tok.send(gen("after", max_new=2))
        b = f.answer(new, token=11)
        assert b.step_id > last and [r.rid for r in b.new_reqs] == ["after"] and from_i32(b.prefix_lens).tolist() == [0]
        f.answer(new, token=12)
        got = f.outs(lambda o: getattr(o, "finish", None))
        assert [t for o in got for t in o.token_ids] == [11, 12] and got[-1].finish == "length"
        assert f.sched.engine.kv.pool_size == 500 and not f.sched.table.running and f.sched.counters.retractions == 7
        f.stop()
        assert isinstance(f.recv(new), Shutdown)
    finally:
        f.stop()
        f.ctx.destroy(linger=0)


# ---- the tokenizer's client --------------------------------------------------------------------
def test_client_health_follows_the_engine(tmp_path):
    info = ModelInfo(model="m", architecture="A", vocab_size=100, context_length=512, pool_size=1000,
                     max_running_requests=8, eos_token_ids=[1], device="cpu", dtype="float32")
    health: list[bool] = []

    async def main() -> None:
        ctx = zmq.asyncio.Context()
        sched = ctx.socket(zmq.ROUTER)
        sched.bind(f"ipc://{tmp_path}/s.ipc")
        recv, send = Codec(ToScheduler), Codec(ToTokenizer)
        client = SchedulerClient(f"ipc://{tmp_path}/s.ipc", "tok")
        await client.start()
        try:
            ident, frame = await asyncio.wait_for(sched.recv_multipart(), WAIT_S)
            assert isinstance(recv.decode(frame), TokenizerHello)
            await sched.send_multipart([ident, send.encode(info)])
            await asyncio.wait_for(client.wait_ready(), WAIT_S)
            client.on_health = health.append
            await sched.send_multipart([ident, send.encode(EngineStatus(serving=False, reason="the worker died"))])
            for _ in range(int(WAIT_S * 100)):
                if not client.ready.is_set():
                    break
                await asyncio.sleep(0.01)
            assert health == [False]
            with pytest.raises(Unavailable, match="not serving: the worker died"):
                client.submit(GenerateReq(rid="x", input_ids=[1, 2], params=SamplingParams()))
            await sched.send_multipart([ident, send.encode(info)])  # a restarted worker is ready
            await asyncio.wait_for(client.ready.wait(), WAIT_S)
            assert health == [False, True]
            client.submit(GenerateReq(rid="y", input_ids=[1, 2], params=SamplingParams()))
            _, frame = await asyncio.wait_for(sched.recv_multipart(), WAIT_S)
            assert recv.decode(frame).rid == "y"
        finally:
            await client.close()
            sched.close(linger=0)
            ctx.term()

    asyncio.run(main())


# ---- the launcher's supervision ----------------------------------------------------------------
def test_restart_budget_counts_within_a_sliding_window():
    now = [0.0]
    budget = RestartBudget(2, 60.0, clock=lambda: now[0])
    assert budget.take() and budget.take() and not budget.take()
    now[0] = 59.0
    assert not budget.take()
    now[0] = 60.5  # the first two left the window
    assert budget.take() and budget.used == 1
    assert not RestartBudget(0, 60.0).take()


def test_process_names_and_endings():
    assert how_it_ended(-9) == "killed by SIGKILL" and how_it_ended(1) == "exit code 1"
    assert how_it_ended(-200).startswith("killed by signal")
    assert worker_group("worker-0") == "worker" and worker_group("worker-2-1") == "worker-2"
