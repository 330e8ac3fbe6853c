"""The scheduler's link to worker rank 0 and how it notices that the worker is gone (transport and
liveness only: what the scheduler does then is ``Scheduler._detach`` / ``_attach``).

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

import time

import zmq

from shared.logging import get_logger
from shared.messages.codec import Codec
from shared.messages.to_worker import ToWorker
from shared.transport import DealerQueue, PeerMonitor

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
