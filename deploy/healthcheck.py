#!/usr/bin/env python3
"""Container health check for the Banyan services (installed in the images as ``banyan-healthcheck``).

    banyan-healthcheck grpc [HOST:PORT]   grpc.health.v1 Check of the server: exit 0 when SERVING
    banyan-healthcheck http [URL]         exit 0 on an HTTP 2xx (e.g. the tokenizer's /health, which
                                          is 503 until the model is loaded, or a /metrics endpoint)

Defaults: 127.0.0.1:$BANYAN_GRPC_PORT (50051) and http://127.0.0.1:$BANYAN_HTTP_PORT/health (8000).
"""

from __future__ import annotations

import os
import sys
import urllib.request


def check_grpc(target: str) -> str | None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(target) as channel:
        try:
            resp = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=3)
        except grpc.RpcError as e:
            return f"{target}: {e.code().name} {e.details()}"
    if resp.status != health_pb2.HealthCheckResponse.SERVING:
        return f"{target}: {health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)}"
    return None


def check_http(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=3) as r:
            r.read(1)
    except OSError as e:  # URLError / HTTPError (non-2xx) / timeouts
        return f"{url}: {e}"
    return None


def main(argv: list[str]) -> int:
    kind = argv[1] if len(argv) > 1 else "grpc"
    if kind == "grpc":
        err = check_grpc(argv[2] if len(argv) > 2 else f"127.0.0.1:{os.environ.get('BANYAN_GRPC_PORT', '50051')}")
    elif kind == "http":
        err = check_http(argv[2] if len(argv) > 2 else
                         f"http://127.0.0.1:{os.environ.get('BANYAN_HTTP_PORT', '8000')}/health")
    else:
        print(__doc__, file=sys.stderr)
        return 2
    if err:
        print(f"unhealthy: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
