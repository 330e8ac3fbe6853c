"""The ports ``banyan serve`` listens on: fixed ones checked before any process starts, and every
one held by the launcher while it runs.

Tokenizer replicas share their gRPC and HTTP ports through ``SO_REUSEPORT``, and so would a second
server started on the same ports: the kernel would split the clients between the two. So a fixed
port is first checked with a plain bind (``SO_REUSEADDR`` only, which lets it pass the
``TIME_WAIT`` connections a stopped server leaves, but not a socket bound or listening there, with
or without ``SO_REUSEPORT``); a taken one stops the launcher with one line naming the port, who
holds it when it is another Banyan (its run directory lists its ports) and the way out. Then the
launcher *holds* the port: a bound, never listening, ``SO_REUSEPORT`` socket (without
``SO_REUSEADDR``, so a second launcher's check fails on it too). The kernel gives the port to no
other program while our services (``SO_REUSEPORT``, same user) can bind it — also a replica
restarted while none other listens."""

from __future__ import annotations

import errno
import socket
from dataclasses import dataclass

from banyan import rundir


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class FixedPort:
    port: int
    flag: str  # the flag that set it, for the message: --grpc-port


class PortBusy(Exception):
    """A fixed port is taken; the message is the one line to print."""


def check_free(ports: list[FixedPort], run_root: str | None = None) -> None:
    """Raise ``PortBusy`` for the first of ``ports`` that cannot be bound."""
    for p in ports:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("0.0.0.0", p.port))
            except OSError as e:
                raise PortBusy(_busy(p, e, run_root)) from e


def _busy(p: FixedPort, e: OSError, run_root: str | None) -> str:
    way_out = f"or pick another with {p.flag} (0: any free port)"
    if e.errno == errno.EACCES:
        return f"port {p.port} ({p.flag}) needs privileges to bind: {way_out}"
    if e.errno != errno.EADDRINUSE:
        return f"port {p.port} ({p.flag}) cannot be bound ({e.strerror}): {way_out}"
    owner = rundir.owner_of_port(p.port, run_root)
    if owner is not None:
        return (f"port {p.port} ({p.flag}) is in use by another Banyan server (launcher pid {owner.pid}): "
                f"stop it (kill {owner.pid}) {way_out}")
    return f"port {p.port} ({p.flag}) is in use by another program: stop it {way_out}"


class PortReservations:
    """Ports the launcher picks or was given for its services, held while they run. A port from
    ``free_port()`` is free only at that instant: seconds pass before a tokenizer binds it, and another
    process can take it meanwhile (the tokenizer then fails with EADDRINUSE). A reservation is a
    bound, never listening, ``SO_REUSEPORT`` socket on the wildcard address: the kernel hands the
    port to no one else, while our services (they bind with ``SO_REUSEPORT`` too, same user) can."""

    def __init__(self) -> None:
        self._socks: list[socket.socket] = []

    def take(self) -> int:
        """A free port, held."""
        return self.hold(0)

    def hold(self, port: int) -> int:
        """Hold ``port`` (0: a free one); ``OSError`` when it is taken."""
        s = socket.socket()
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            s.bind(("0.0.0.0", port))
        except OSError:
            s.close()
            raise
        self._socks.append(s)
        return s.getsockname()[1]

    def hold_fixed(self, ports: list[FixedPort], run_root: str | None = None) -> None:
        """Check ``ports`` (``check_free``) and hold them; ``PortBusy`` names the first taken."""
        check_free(ports, run_root)
        for p in ports:
            try:
                self.hold(p.port)
            except OSError as e:  # taken between the check and here
                raise PortBusy(_busy(p, e, run_root)) from e

    def release(self) -> None:
        for s in self._socks:
            s.close()
        self._socks.clear()
