"""Serve the HTTP app with uvicorn as a task of the tokenizer's own event loop.

The listening socket is made here with SO_REUSEPORT, so replicas on one host share the port as
they share gRPC's (the kernel spreads connections over them). Signals stay with the tokenizer,
which stops this server (graceful, like gRPC) on SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Callable, Iterator

import uvicorn
from starlette.types import ASGIApp


def listen_socket(host: str, port: int) -> socket.socket:
    """A bound TCP socket that other replicas can bind too (``port`` 0: a free one)."""
    family, type_, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                       flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, type_, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(addr)
    except OSError:
        sock.close()
        raise
    return sock


class _Uvicorn(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # the tokenizer owns SIGINT/SIGTERM and calls HttpServer.stop


class HttpServer:
    """``on_grace_expired`` ends the requests still in flight when the grace period is over (they
    then finish well-formed); requests still running ``_ABORT_SLACK`` seconds later are cancelled."""

    _ABORT_SLACK = 5.0

    def __init__(self, app: ASGIApp, host: str, port: int, grace_seconds: float,
                 on_grace_expired: Callable[[], None] = lambda: None) -> None:
        self.sock = listen_socket(host, port)
        self.grace, self.on_grace_expired = grace_seconds, on_grace_expired
        self.port: int = self.sock.getsockname()[1]
        for name in ("uvicorn", "uvicorn.error"):  # its start/stop lines at info would not be JSON
            logging.getLogger(name).setLevel(logging.WARNING)
        config = uvicorn.Config(app, lifespan="off", log_config=None, access_log=False, server_header=False,
                                timeout_graceful_shutdown=grace_seconds + self._ABORT_SLACK)  # type: ignore[arg-type]
        self._server = _Uvicorn(config)
        self.task: asyncio.Task | None = None

    def start(self) -> asyncio.Task:
        self.task = asyncio.create_task(self._server.serve(sockets=[self.sock]), name="http")
        return self.task

    async def stop(self) -> None:
        """Stop accepting, let requests in flight finish (up to the grace period), then return."""
        self._server.should_exit = True
        if self.task is None or self.task.done():
            return
        done, _ = await asyncio.wait({self.task}, timeout=self.grace)
        if not done:
            self.on_grace_expired()
            await self.task
