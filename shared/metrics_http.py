"""A process's Prometheus ``/metrics`` endpoint (scheduler, worker): always the classic text
format. prometheus_client's own server negotiates OpenMetrics, and an OpenMetrics scrape without
an escaping parameter (Prometheus 2.x's default) renames the ``banyan:`` metrics to ``banyan_``,
so dashboards would see different names depending on the scraper."""

from __future__ import annotations

import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest


class _ReusePortServer(ThreadingHTTPServer):
    """Binds with ``SO_REUSEPORT``: ``banyan serve`` holds the ports it picks for its services
    (``PortReservations``) while they run."""

    def server_bind(self) -> None:
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        super().server_bind()


def serve_metrics(port: int, registry: CollectorRegistry, host: str = "0.0.0.0") -> ThreadingHTTPServer:
    """Serve ``GET /metrics`` of ``registry`` on ``port`` from a daemon thread; ``shutdown()`` stops it."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            if self.path.split("?")[0] not in ("/metrics", "/"):
                self.send_error(404)
                return
            body = generate_latest(registry)
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE_LATEST)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:  # scrapes are not worth a log line
            pass

    server = _ReusePortServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return server
