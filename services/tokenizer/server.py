"""Tokenizer replica: gRPC server (health, reflection) and the OpenAI-compatible HTTP server in one
event loop, the link to the scheduler, graceful stop."""

from __future__ import annotations

import asyncio
import os
import signal

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from shared.config import ConfigError, TokenizerConfig
from shared.gc_pause import FullCollections, freeze_heap, pace
from shared.logging import get_logger
from shared.loop_lag import watch_lag
from shared.model_path import resolve_model
from shared.proto.banyan.v1 import generation_pb2 as pb
from shared.proto.banyan.v1 import generation_pb2_grpc as pb_grpc
from shared.tracing import make_tracer
from services.tokenizer.auth import ApiKey
from services.tokenizer.interceptor import AuthInterceptor, ErrorInterceptor
from services.tokenizer.metrics import TokenizerMetrics
from services.tokenizer.chat_output import OutputParsers
from services.tokenizer.router import Router
from services.tokenizer.scheduler_client import SchedulerClient
from services.tokenizer.servicer import GenerationServicer
from services.tokenizer.text import TextProcessor

log = get_logger("tokenizer")
SERVICE = pb.DESCRIPTOR.services_by_name["GenerationService"].full_name
MAX_MESSAGE = 64 << 20


async def run(cfg: TokenizerConfig) -> None:
    model_dir, _ = resolve_model(cfg.model)
    text = TextProcessor(model_dir)
    parsers = OutputParsers.configured(cfg.tool_call_parser, cfg.reasoning_parser,
                                       getattr(text.tokenizer, "chat_template", None))
    log.info("output_parsers", tool_call_parser=parsers.tool or "none", reasoning_parser=parsers.reasoning or "none")
    router = Router(len(cfg.scheduler_endpoints), cfg.router_block_tokens, cfg.router_max_blocks,
                    cfg.router_balance_abs, cfg.router_balance_rel)
    client = SchedulerClient(cfg.scheduler_endpoints, cfg.identity, router, cfg.router_probe_interval,
                             cfg.scheduler_gone_grace, cfg.restart_wait)
    api_key = ApiKey(cfg.api_key)
    interceptors = [AuthInterceptor(api_key)] if api_key.required else []

    def grpc_server() -> grpc.aio.Server:
        return grpc.aio.server(interceptors=[*interceptors, ErrorInterceptor()],
                               options=[("grpc.max_receive_message_length", MAX_MESSAGE),
                                        ("grpc.max_send_message_length", MAX_MESSAGE)])

    server = grpc_server()
    metrics, tracer = TokenizerMetrics(), make_tracer("tokenizer", cfg.otlp_endpoint)
    servicer = GenerationServicer(text, client, metrics, tracer)
    servicer.parsers = parsers
    pb_grpc.add_GenerationServiceServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    # SMG's engine service, on this server or (--smg-grpc-port) its own
    smg = None
    if not cfg.disable_smg_grpc:
        from services.tokenizer.smg import SmgFront  # (smg-grpc-proto is imported only when the service is on)

        smg = SmgFront(cfg, text, client, model_dir, metrics, tracer)
    names = (SERVICE, *((smg.SERVICE,) if smg else ()))
    reflection.enable_server_reflection((*names, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    for name in ("", *names):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    port = server.add_insecure_port(f"{cfg.host}:{cfg.grpc_port}")
    smg_port = smg.attach(server, grpc_server, health_servicer) if smg else -1
    http = None
    if cfg.http_port >= 0:  # (FastAPI and uvicorn are imported only when the HTTP API is served)
        from services.tokenizer.http.app import create_app
        from services.tokenizer.http.server import HttpServer

        app = create_app(text, client, api_key, metrics, tracer)
        app.state.frontend.aliases = frozenset(cfg.served_model_names)  # requests may name any
        app.state.frontend.parsers = parsers
        http = HttpServer(app, cfg.host, cfg.http_port, cfg.grace_seconds, app.state.frontend.abort_all)
    http_port = http.port if http else -1
    freeze_heap()  # transformers, the tokenizer, the apps: out of the collector's walk (shared/gc_pause.py)
    await server.start()
    if smg is not None:
        await smg.start()
    await client.start()
    # smg_grpc_port: where SMG's service answers (the gRPC port itself when it shares it; -1: off), as the launcher says
    log.info("tokenizer_listening", grpc_port=port, http_port=http_port,
             smg_grpc_port=-1 if smg is None else port if smg_port < 0 else smg_port,
             replica=cfg.identity, api_key=api_key.required)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    failed = False

    def http_ended(task: asyncio.Task) -> None:
        nonlocal failed
        if not stop.is_set():  # uvicorn ended on its own: fail the replica rather than serve gRPC only
            failed = True
            log.error("http_server_exited", error=repr(task.exception()) if not task.cancelled() else "cancelled")
            stop.set()

    if http is not None:
        http.start().add_done_callback(http_ended)

    def schedulers_gone() -> None:  # every scheduler connection closed for scheduler_gone_grace (logged)
        nonlocal failed
        failed = True
        stop.set()

    client.watch.on_gone = schedulers_gone

    async def set_health(serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", *names):
            await health_servicer.set(name, status)

    async def mark_ready() -> None:
        nonlocal failed
        try:
            await client.wait_ready()
        except ConfigError:  # the data-parallel groups serve different models (logged): fail the replica
            failed = True
            stop.set()
            return

        def health_changed(serving: bool) -> None:  # every data-parallel group down, or one back
            if not stop.is_set():
                loop.create_task(set_health(serving))

        client.on_health = health_changed
        await set_health(True)
        if cfg.port_file:  # written once serving, so launchers can wait on it
            with open(cfg.port_file + ".tmp", "w") as f:
                f.write(f"{port}\n{http_port}\n")
            os.replace(cfg.port_file + ".tmp", cfg.port_file)
        log.info("tokenizer_serving", grpc_port=port, http_port=http_port)

    ready_task = asyncio.create_task(mark_ready())
    # full collections when no stream is open, or every --gc-full-interval s (shared/gc_pause.py)
    gc_task = asyncio.create_task(pace(FullCollections(cfg.gc_full_interval), lambda: client.streams_open > 0,
                                       metrics.gc_flush))
    lag_task = asyncio.create_task(watch_lag(metrics.loop_lag.observe))
    await stop.wait()
    log.info("tokenizer_stopping")
    ready_task.cancel()
    gc_task.cancel()
    lag_task.cancel()
    client.closing = True
    for name in ("", *names):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    await asyncio.gather(server.stop(cfg.grace_seconds), *([http.stop()] if http is not None else []),
                         *([smg.stop(cfg.grace_seconds)] if smg is not None else []))
    await client.close()
    tracer.shutdown()
    log.info("tokenizer_stopped")
    if failed:
        raise SystemExit(1)


def main_async(cfg: TokenizerConfig) -> None:
    try:
        import uvloop

        uvloop.run(run(cfg))
    except ImportError:
        asyncio.run(run(cfg))
