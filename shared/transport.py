"""Typed queues over ZeroMQ sockets. Each queue encodes what it sends with the codec of the peer's
channel and decodes what it receives with its own; a frame that fails to decode is dropped and
logged, never executed. Endpoints are internal (ipc:// on one host, a private network in compose).
"""

from __future__ import annotations

import os
from typing import Any, Generic, TypeVar

import zmq
import zmq.asyncio
from zmq.utils.monitor import recv_monitor_message

from shared.logging import get_logger
from shared.messages.codec import Codec, WireError

In = TypeVar("In")
Out = TypeVar("Out")
log = get_logger("transport")


def _prepare(endpoint: str) -> None:
    if endpoint.startswith("ipc://"):
        d = os.path.dirname(endpoint[len("ipc://"):])
        if d:
            os.makedirs(d, exist_ok=True)


def _socket(ctx: zmq.Context, kind: int, endpoint: str, bind: bool, identity: str = "",
            options: dict[int, int] | None = None) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    for opt, value in (options or {}).items():  # (before bind/connect: connections copy them)
        sock.setsockopt(opt, value)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    if identity:
        sock.setsockopt(zmq.IDENTITY, identity.encode())
    if kind == zmq.ROUTER:
        sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
    _prepare(endpoint)
    if bind:
        sock.bind(endpoint)
    else:
        sock.connect(endpoint)
    return sock


class RouterQueue(Generic[In, Out]):
    """Bound ROUTER (scheduler side): many identified peers connect with DEALER sockets."""

    def __init__(self, ctx: zmq.Context, endpoint: str, recv: Codec[In], send: Codec[Out]) -> None:
        self.sock = _socket(ctx, zmq.ROUTER, endpoint, bind=True)
        self._recv, self._send = recv, send

    def recv_nowait(self) -> tuple[bytes, In] | None:
        """One (peer identity, message), or None when nothing is pending."""
        while True:
            try:
                ident, frame = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return None
            except ValueError:  # wrong frame count
                log.warning("bad_frame", reason="frame count")
                continue
            try:
                return ident.bytes, self._recv.decode(frame.buffer)
            except WireError as e:
                log.warning("bad_frame", peer=ident.bytes.decode(errors="replace"), reason=str(e))

    def send(self, ident: bytes, msg: Out) -> None:
        self.sock.send_multipart([ident, self._send.encode(msg)], copy=False)


class DealerQueue(Generic[In, Out]):
    """A DEALER socket (blocking API): worker rank 0 ↔ scheduler, either side may bind."""

    def __init__(self, ctx: zmq.Context, endpoint: str, recv: Codec[In], send: Codec[Out],
                 bind: bool = False, identity: str = "", options: dict[int, int] | None = None) -> None:
        self.sock = _socket(ctx, zmq.DEALER, endpoint, bind=bind, identity=identity, options=options)
        self._recv, self._send = recv, send

    def recv(self, timeout_ms: int | None = None) -> In | None:
        """Next valid message; None on timeout."""
        while True:
            if timeout_ms is not None and not self.sock.poll(timeout_ms):
                return None
            frame = self.sock.recv(copy=False)
            try:
                return self._recv.decode(frame.buffer)
            except WireError as e:
                log.warning("bad_frame", reason=str(e))

    def recv_nowait(self) -> In | None:
        return self.recv(timeout_ms=0)

    def send(self, msg: Out, flags: int = 0) -> None:
        """``flags=zmq.NOBLOCK``: raise ``zmq.Again`` instead of blocking while no peer is connected."""
        self.sock.send(self._send.encode(msg), flags, copy=False)


class PeerMonitor:
    """A socket's connections, from its ZMQ monitor events: a peer process that exits, or whose
    connection libzmq drops for missing heartbeats (``zmq.HEARTBEAT_*`` options), is noticed
    without any message."""

    EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED

    def __init__(self, sock: zmq.Socket) -> None:
        self.sock = sock.get_monitor_socket(self.EVENTS)  # a PAIR socket: poll it to wake on a change
        self.fds: set[int] = set()  # the connections open now (file descriptors)
        self.disconnects = 0

    def update(self) -> list[tuple[int, int]]:
        """Take the pending events: (event, fd) in the order they happened (an fd may be reused)."""
        events = []
        while self.sock.get(zmq.EVENTS) & zmq.POLLIN:  # (cheaper than a receive that fails)
            m = recv_monitor_message(self.sock)
            event, fd = int(m["event"]), int(m["value"])
            if event == zmq.EVENT_DISCONNECTED:
                self.fds.discard(fd)
                self.disconnects += 1
            else:
                self.fds.add(fd)
            events.append((event, fd))
        return events


class AsyncDealerQueue(Generic[In, Out]):
    """A connected DEALER socket for asyncio code (tokenizer replicas)."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, recv: Codec[In], send: Codec[Out],
                 identity: str) -> None:
        self.sock = _socket(ctx, zmq.DEALER, endpoint, bind=False, identity=identity)
        self._recv, self._send = recv, send

    async def recv(self) -> In:
        while True:
            frame = await self.sock.recv(copy=False)
            try:
                return self._recv.decode(frame.buffer)
            except WireError as e:
                log.warning("bad_frame", reason=str(e))

    def send(self, msg: Any) -> None:
        self.sock.send(self._send.encode(msg), flags=zmq.NOBLOCK, copy=False)

    def close(self) -> None:
        self.sock.close(linger=0)
