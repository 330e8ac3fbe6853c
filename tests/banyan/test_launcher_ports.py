"""The launcher holds the ports it picks (``PortReservations``): nobody else can bind them while
the services it starts (SO_REUSEPORT listeners, like the tokenizers' gRPC/HTTP and the metrics
endpoints) can, and connections reach the listener, never the reservation."""

import errno
import socket
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, Counter

from banyan.launcher import PortReservations
from shared.metrics_http import serve_metrics
from services.tokenizer.http.server import listen_socket


def test_reserved_port_refuses_strangers_and_admits_our_listeners():
    ports = PortReservations()
    port = ports.take()
    try:
        with socket.socket() as stranger:  # an unrelated process binding the port (no SO_REUSEPORT)
            with pytest.raises(OSError) as e:
                stranger.bind(("127.0.0.1", port))
            assert e.value.errno == errno.EADDRINUSE
        ours = listen_socket("127.0.0.1", port)  # what the tokenizer's HTTP server binds
        ours.listen()
        with socket.create_connection(("127.0.0.1", port), timeout=5) as c:
            peer, _ = ours.accept()  # the connection reaches the listener, not the reservation
            c.sendall(b"x")
            assert peer.recv(1) == b"x"
            peer.close()
        ours.close()
    finally:
        ports.release()


def test_released_port_is_free_again():
    ports = PortReservations()
    port = ports.take()
    ports.release()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_metrics_endpoint_binds_a_reserved_port():
    ports = PortReservations()
    port = ports.take()
    reg = CollectorRegistry()
    Counter("banyan:test_total", "t", registry=reg).inc()
    server = serve_metrics(port, reg, host="127.0.0.1")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            assert "banyan:test_total 1.0" in r.read().decode()
    finally:
        server.shutdown()
        server.server_close()
        ports.release()
