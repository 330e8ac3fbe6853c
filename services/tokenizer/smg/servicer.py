"""``sglang.grpc.scheduler.SglangScheduler`` (smg-grpc-proto): the gRPC service the Shepherd Model
Gateway (SMG) drives engines with, served by a tokenizer replica beside ``banyan.v1``.

SMG tokenizes and applies chat templates itself and sends token ids; this servicer runs them on
Banyan's own request path (``validation.prepare`` → ``Generator.stream``: stop strings, aborts on
cancel, metrics and stage logs as for the other fronts) and answers with token ids, which the
gateway detokenizes. Management calls map onto the replica's scheduler link: ``GetLoads`` (one
entry per data-parallel group), ``HealthCheck``, ``Abort``, ``FlushCache``; ``GetTokenizer``
streams the model's tokenizer files; ``SubscribeKvEvents`` relays the schedulers' KV-cache events
(``kv_relay.py``). Embeddings, profiling and LoRA answer UNIMPLEMENTED.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path

import grpc
from google.protobuf.struct_pb2 import Struct
from google.protobuf.timestamp_pb2 import Timestamp
from smg_grpc_proto.generated import common_pb2 as common
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from shared.errors import InvalidArgument, Unavailable
from shared.logging import stage
from shared.messages.to_tokenizer import Load, ModelInfo
from shared.tracing import Trace, Tracer
from services.tokenizer import validation
from services.tokenizer.flush import Flusher
from services.tokenizer.generation import Generator
from services.tokenizer.metrics import TokenizerMetrics
from services.tokenizer.scheduler_client import SchedulerClient
from services.tokenizer.smg import bundle, convert
from services.tokenizer.smg.kv_relay import KvRelay
from services.tokenizer.text import TextProcessor

SERVICE = pb.DESCRIPTOR.services_by_name["SglangScheduler"].full_name
LOAD_SECTIONS = ("core", "memory", "spec", "lora", "disagg", "queues", "all")


def _traceparent(context: grpc.aio.ServicerContext) -> str:
    for key, value in context.invocation_metadata() or ():
        if key == "traceparent":
            return value
    return ""


def _struct(d: dict) -> Struct:
    s = Struct()
    s.update(d)
    return s


def scheduler_load(g: int, load: Load, info: ModelInfo, sections: set[str]) -> pb.SchedulerLoad:
    """One group's load as SGLang reports it. ``token_usage``: the share of the KV pool running
    requests hold (their slots and the cached prefixes they lock; reclaimable cache excluded)."""
    used = load.kv_pool - load.kv_free - load.kv_evictable
    computed = load.prefill_computed_tokens + load.prefill_cached_tokens
    out = pb.SchedulerLoad(dp_rank=g, num_running_reqs=load.num_running, num_waiting_reqs=load.num_waiting,
                           num_total_reqs=load.num_running + load.num_waiting, num_used_tokens=used,
                           max_total_num_tokens=load.kv_pool, token_usage=used / load.kv_pool if load.kv_pool else 0.0,
                           cache_hit_rate=load.prefill_cached_tokens / computed if computed else 0.0,
                           utilization=load.num_running / max(info.max_running_requests, 1),
                           max_running_requests=info.max_running_requests)
    if sections & {"memory", "all"}:
        out.memory.CopyFrom(pb.MemoryMetrics(token_capacity=load.kv_pool))
    if sections & {"queues", "all"}:
        out.queues.CopyFrom(pb.QueueMetrics(waiting=load.num_waiting))
    return out


class SmgServicer(pb_grpc.SglangSchedulerServicer):
    def __init__(self, text: TextProcessor, client: SchedulerClient, model_dir: str, relay: KvRelay | None = None,
                 metrics: TokenizerMetrics | None = None, tracer: Tracer | None = None) -> None:
        self.text, self.client, self.model_dir = text, client, Path(model_dir)
        self.generator = Generator(text, client, metrics, tracer)
        self.relay = relay
        self.started = time.time()
        self.active = 0  # Generate calls in flight here
        self._zip: tuple[bytes, str] | None = None
        cfg = self.model_dir / "config.json"
        self.hf_config = json.loads(cfg.read_text()) if cfg.is_file() else {}
        self.flusher = Flusher.for_client(client)

    # ---- generation ----------------------------------------------------------------------------
    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        rid = request.request_id or uuid.uuid4().hex
        trace = Trace.incoming(_traceparent(context))
        stage("received", rid, trace_id=trace.trace_id, rpc="smg")
        convert.check_supported(request)
        try:
            p = validation.prepare(convert.prompt(request), convert.sampling(request), self.text, self.client.model_info(),
                                   request_id=rid, prefix="sampling_params.", constraint=convert.constraint(request))
        except InvalidArgument as e:
            raise convert.smg_names(e) from None
        if request.HasField("data_parallel_rank") and not 0 <= request.data_parallel_rank < len(self.client.links):
            raise InvalidArgument(f"data_parallel_rank {request.data_parallel_rank} is not in "
                                  f"[0, {len(self.client.links)})")
        stage("tokenized", rid, trace_id=trace.trace_id, prompt_tokens=len(p.req.input_ids), n=p.req.n)
        branches = [convert.Branch() for _ in range(p.req.n)]
        top = request.return_logprob and request.top_logprobs_num > 0
        group = request.data_parallel_rank if request.HasField("data_parallel_rank") else None
        stream = self.generator.stream(p, rid, trace, group=group)
        self.active += 1
        try:
            async for c in stream:
                b = branches[c.index]
                b.ids += c.token_ids
                if c.logprobs:
                    b.lps += c.logprobs
                if c.prompt_logprobs:
                    b.prompt_lps = c.prompt_logprobs
                if request.stream:
                    yield convert.stream_chunk(rid, c, b, len(p.req.input_ids), top)
                if c.finish:
                    yield convert.complete(rid, c, b, request.stream, top)
        finally:
            self.active -= 1
            await stream.aclose()

    async def Abort(self, request: pb.AbortRequest, context) -> pb.AbortResponse:
        if not request.request_id:
            raise InvalidArgument("request_id must not be empty")
        found = self.client.in_flight(request.request_id)
        if found:
            self.client.abort(request.request_id)
        return pb.AbortResponse(success=found, message=f"request {request.request_id!r} "
                                + ("aborted" if found else "is not in flight here"))

    # ---- engine state --------------------------------------------------------------------------
    async def HealthCheck(self, request, context) -> pb.HealthCheckResponse:
        """Healthy when the model is loaded, the replica is not shutting down, a group serves (a
        lost worker's group does not) and the schedulers answer a load probe (their loops are
        alive; with data parallelism a silent group is routed around, as Banyan's health says)."""
        if self.client.closing:
            return pb.HealthCheckResponse(healthy=False, message="shutting down")
        if not self.client.ready.is_set():
            return pb.HealthCheckResponse(healthy=False, message="the engine is not serving")
        try:
            await self.client.loads(timeout=5.0)
        except Unavailable as e:
            if len(self.client.links) == 1:
                return pb.HealthCheckResponse(healthy=False, message=str(e))
        return pb.HealthCheckResponse(healthy=True, message="serving")

    async def GetModelInfo(self, request, context) -> pb.GetModelInfoResponse:
        i, tok = self.client.model_info(), self.text.tokenizer
        return pb.GetModelInfoResponse(
            model_path=i.model, tokenizer_path=i.model, is_generation=True, served_model_name=i.model,
            max_context_length=i.context_length, vocab_size=i.vocab_size, supports_vision=False,
            model_type=self.hf_config.get("model_type", ""), eos_token_ids=i.eos_token_ids,
            pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else 0,
            bos_token_id=tok.bos_token_id if tok.bos_token_id is not None else 0,
            max_req_input_len=i.context_length - 1, architectures=[i.architecture])

    async def GetServerInfo(self, request, context) -> pb.GetServerInfoResponse:
        i = self.client.model_info()
        start = Timestamp()
        start.FromSeconds(int(self.started))
        groups = len(self.client.links)
        args = {"model_path": i.model, "served_model_name": i.model, "context_length": i.context_length,
                "max_running_requests": i.max_running_requests, "dp_size": groups, "device": i.device,
                "dtype": i.dtype, "kv_events": self.relay is not None}
        sched = {"max_total_num_tokens": i.pool_size, "max_req_input_len": i.context_length - 1,
                 "max_running_requests": i.max_running_requests, "is_generation": True}
        return pb.GetServerInfoResponse(server_args=_struct(args), scheduler_info=_struct(sched),
                                        active_requests=self.active, is_paused=False,
                                        uptime_seconds=time.time() - self.started, sglang_version=_version(),
                                        server_type="grpc", start_time=start, max_total_num_tokens=i.pool_size)

    async def GetLoads(self, request: pb.GetLoadsRequest, context) -> pb.GetLoadsResponse:
        sections = set(request.include) or {"all"}
        bad = sorted(sections - set(LOAD_SECTIONS))
        if bad:
            raise InvalidArgument(f"include: unknown section(s) {bad}; known: {list(LOAD_SECTIONS)}")
        info, loads = self.client.model_info(), await self.client.loads()
        ranks = range(len(loads))
        if request.HasField("dp_rank"):
            if request.dp_rank not in ranks:
                raise InvalidArgument(f"dp_rank {request.dp_rank} is not in [0, {len(loads)})")
            ranks = [request.dp_rank]
        out = [scheduler_load(g, loads[g], info, sections) for g in ranks]
        n = len(out) or 1
        agg = pb.AggregateMetrics(total_running_reqs=sum(x.num_running_reqs for x in out),
                                  total_waiting_reqs=sum(x.num_waiting_reqs for x in out),
                                  total_reqs=sum(x.num_total_reqs for x in out),
                                  avg_token_usage=sum(x.token_usage for x in out) / n,
                                  avg_utilization=sum(x.utilization for x in out) / n)
        return pb.GetLoadsResponse(timestamp=datetime.now(timezone.utc).isoformat(), version=_version(),
                                   dp_rank_count=len(loads), loads=out, aggregate=agg)

    async def FlushCache(self, request: common.FlushCacheRequest, context) -> common.FlushCacheResponse:
        """Drop every cached prefix in every group. A group with requests in flight refuses; with
        ``timeout_s`` > 0 the call waits up to that long for the groups to go idle."""
        ok, message = await self.flusher.flush(request.timeout_s)
        return common.FlushCacheResponse(success=ok, message=message)

    async def GetTokenizer(self, request, context):
        if self._zip is None:
            try:
                self._zip = await asyncio.to_thread(bundle.tokenizer_zip, self.model_dir)
            except FileNotFoundError as e:
                raise Unavailable(str(e)) from None
        data, digest = self._zip
        parts = bundle.chunks(data)
        for i, part in enumerate(parts):
            yield common.GetTokenizerChunk(data=part, sha256=digest if i == len(parts) - 1 else "")

    async def SubscribeKvEvents(self, request: common.SubscribeKvEventsRequest, context):
        if self.relay is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED,
                                "KV events are off on this server (started with --disable-kv-events)")
        self.client.model_info()
        await context.send_initial_metadata(())  # the subscriber's call resolves before the first batch
        async for batch in self.relay.subscribe(request.start_sequence_number):
            yield batch

    # ---- what Banyan does not do -----------------------------------------------------------------
    async def Embed(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Banyan serves generation only: embeddings are not "
                                                           "supported")

    async def StartProfile(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "profiling is not supported by Banyan")

    async def StopProfile(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "profiling is not supported by Banyan")

    async def LoadLoRAAdapter(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "LoRA adapters are not supported by Banyan")

    async def UnloadLoRAAdapter(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "LoRA adapters are not supported by Banyan")

    async def ListLoadedLoRAAdapters(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "LoRA adapters are not supported by Banyan")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"banyan-{version('banyan')}"
    except PackageNotFoundError:
        return "banyan"
