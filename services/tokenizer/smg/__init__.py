"""The Shepherd Model Gateway's engine API on a tokenizer replica: the ``sglang.grpc.scheduler
.SglangScheduler`` service of ``smg-grpc-proto`` (its generated stubs, pinned; see
``servicer.py``), served beside ``banyan.v1`` on the replica's gRPC port or on its own
(``--smg-grpc-port``), and the relay of the schedulers' KV-cache events (``kv_relay.py``)."""

from __future__ import annotations

from collections.abc import Callable

import grpc
from grpc_health.v1 import health, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from shared.config import TokenizerConfig
from shared.tracing import Tracer
from services.tokenizer.metrics import TokenizerMetrics
from services.tokenizer.scheduler_client import SchedulerClient
from services.tokenizer.smg.kv_relay import KvRelay
from services.tokenizer.smg.servicer import SERVICE, SmgServicer
from services.tokenizer.text import TextProcessor


class SmgFront:
    SERVICE = SERVICE

    def __init__(self, cfg: TokenizerConfig, text: TextProcessor, client: SchedulerClient, model_dir: str,
                 metrics: TokenizerMetrics | None = None, tracer: Tracer | None = None) -> None:
        self.cfg = cfg
        self.relay = None if cfg.disable_kv_events else KvRelay(client)
        self.servicer = SmgServicer(text, client, model_dir, self.relay, metrics, tracer)
        self.server: grpc.aio.Server | None = None  # its own, with --smg-grpc-port

    def attach(self, main: grpc.aio.Server, new_server: Callable[[], grpc.aio.Server],
               health_servicer: health.aio.HealthServicer) -> int:
        """Add the service to ``main`` (→ -1: same port) or to a server of its own (→ its port)."""
        if self.cfg.smg_grpc_port < 0:
            pb_grpc.add_SglangSchedulerServicer_to_server(self.servicer, main)
            return -1
        self.server = new_server()
        pb_grpc.add_SglangSchedulerServicer_to_server(self.servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, self.server)
        reflection.enable_server_reflection((SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), self.server)
        return self.server.add_insecure_port(f"{self.cfg.host}:{self.cfg.smg_grpc_port}")

    async def start(self) -> None:
        if self.server is not None:
            await self.server.start()

    async def stop(self, grace: float) -> None:
        """KV-event streams end first (they never finish on their own), then its own server."""
        if self.relay is not None:
            self.relay.close()
        if self.server is not None:
            await self.server.stop(grace)
