"""The public ``banyan.v1.GenerationService``: proto ↔ domain at the edge, streaming, cancel."""

from __future__ import annotations

import dataclasses
import uuid

import grpc

from shared.errors import InvalidArgument
from shared.logging import stage
from shared.messages.common import Constraint, FinishReason
from shared.messages.to_tokenizer import Load
from shared.proto.banyan.v1 import generation_pb2 as pb
from shared.proto.banyan.v1 import generation_pb2_grpc as pb_grpc
from shared.tracing import Trace, Tracer
from services.tokenizer import tokens, tool_rpc, validation
from services.tokenizer.chat_output import OutputParsers
from services.tokenizer.generation import Chunk, Generator
from services.tokenizer.metrics import TokenizerMetrics
from services.tokenizer.scheduler_client import SchedulerClient, total_load
from services.tokenizer.scoring import Scorer
from services.tokenizer.sessions import SessionFront
from services.tokenizer.text import Message, TextProcessor
from services.tokenizer.validation import Prompt, SamplingRequest

FINISH = {FinishReason.STOP: pb.FINISH_REASON_STOP, FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
          FinishReason.ABORT: pb.FINISH_REASON_ABORT}


def _traceparent(context: grpc.aio.ServicerContext) -> str:
    for key, value in context.invocation_metadata() or ():
        if key == "traceparent":
            return value
    return ""


def _prompt(req: pb.GenerateRequest | pb.ScoreRequest | pb.PinPrefixRequest, add_default: bool = True) -> Prompt:
    kind = req.WhichOneof("input")
    if kind == "text":
        return Prompt(text=req.text)
    if kind == "token_ids":
        return Prompt(token_ids=list(req.token_ids.ids))
    if kind == "chat":
        add = req.chat.add_generation_prompt if req.chat.HasField("add_generation_prompt") else add_default
        return Prompt(messages=_messages(req.chat), add_generation_prompt=add)
    raise InvalidArgument("one of text, token_ids or chat is required")


def _messages(chat: pb.ChatInput) -> list[Message]:
    msgs = [Message(m.role, m.content, **tool_rpc.message_fields(m, i)) for i, m in enumerate(chat.messages)]
    validation.check_messages(msgs, "chat.messages")
    return msgs


def _constraint(req: pb.GenerateRequest) -> Constraint | None:
    kind = req.WhichOneof("constraint")
    if kind is None:
        return None
    if kind == "choice":
        return Constraint(kind, choices=list(req.choice.choices))
    if kind == "json_object":
        return Constraint(kind) if req.json_object else None
    return Constraint(kind, value=getattr(req, kind))


def _sampling(sp: pb.SamplingParams) -> SamplingRequest:
    def opt(name: str):
        return getattr(sp, name) if sp.HasField(name) else None

    return SamplingRequest(max_tokens=opt("max_tokens"), temperature=opt("temperature"), top_p=opt("top_p"),
                           top_k=opt("top_k"), min_p=opt("min_p"), seed=opt("seed"), n=opt("n"),
                           stop=list(sp.stop), stop_token_ids=list(sp.stop_token_ids), ignore_eos=sp.ignore_eos,
                           skip_special_tokens=True if opt("skip_special_tokens") is None else sp.skip_special_tokens,
                           presence_penalty=opt("presence_penalty"), frequency_penalty=opt("frequency_penalty"),
                           logprobs=sp.logprobs, top_logprobs=opt("top_logprobs"),
                           stream_interval=opt("stream_interval"), prompt_logprobs_start=opt("prompt_logprobs_start"),
                           prompt_top_logprobs=opt("prompt_top_logprobs"), logit_bias=dict(sp.logit_bias) or None,
                           min_tokens=opt("min_tokens"), repetition_penalty=opt("repetition_penalty"))


def _response(rid: str, c: Chunk) -> pb.GenerateResponse:
    resp = pb.GenerateResponse(request_id=rid, index=c.index, token_ids=c.token_ids, text=c.text,
                               finish_reason=FINISH.get(c.finish, pb.FINISH_REASON_UNSPECIFIED),
                               matched_stop=c.matched_stop)
    if c.usage is not None:
        resp.usage.CopyFrom(pb.Usage(prompt_tokens=c.usage.prompt_tokens, completion_tokens=c.usage.completion_tokens,
                                     cached_tokens=c.usage.cached_tokens))
    if c.matched_stop_token_id is not None:
        resp.matched_stop_token_id = c.matched_stop_token_id
    for t in c.logprobs or ():
        resp.logprobs.append(pb.GeneratedTokenLogprobs(
            token=pb.TokenLogprob(token_id=t.token_id, logprob=t.logprob),
            top=[pb.TokenLogprob(token_id=i, logprob=lp) for i, lp in t.top]))
    for t in c.prompt_logprobs or ():
        entry = resp.prompt_logprobs.add(token_id=t.token_id, top=[pb.TokenLogprob(token_id=i, logprob=lp)
                                                                   for i, lp in t.top])
        if t.logprob is not None:
            entry.logprob = t.logprob
    return resp


class GenerationServicer(pb_grpc.GenerationServiceServicer):
    def __init__(self, text: TextProcessor, client: SchedulerClient, metrics: TokenizerMetrics | None = None,
                 tracer: Tracer | None = None) -> None:
        self.text = text
        self.client = client
        self.generator = Generator(text, client, metrics, tracer)
        self.scorer = Scorer(text, client)
        self.sessions = SessionFront(client)
        self.parsers = OutputParsers()  # --tool-call-parser, --reasoning-parser (set by the server)

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        rid = request.request_id or uuid.uuid4().hex
        trace = Trace.incoming(_traceparent(context))
        stage("received", rid, trace_id=trace.trace_id)
        info = self.client.model_info()
        prompt, sampling = _prompt(request), _sampling(request.sampling_params)
        kw = dict(request_id=request.request_id, cache_salt=request.cache_salt, prefix="sampling_params.",
                  priority=request.priority)
        session = None
        if request.session_id:
            validation.precheck(prompt, sampling, info, **kw)  # (bad input is INVALID_ARGUMENT, session or not)
            session = await self.sessions.view(request.session_id, request.session_parent)
        elif request.session_parent:
            raise InvalidArgument("session_parent needs session_id")
        constraint = _constraint(request)
        tool_plan, extras = tool_rpc.plan(request, self.parsers.tool, constraint is not None)
        if extras is not None:
            prompt = dataclasses.replace(prompt, extras=extras)
        p = validation.prepare(prompt, sampling, self.text, info, constraint=tool_plan.constraint or constraint,
                               session=session, **kw)
        stage("tokenized", rid, trace_id=trace.trace_id, prompt_tokens=len(p.req.input_ids), n=p.req.n)
        split = None
        if tool_rpc.ResponseSplit.needed(tool_plan, self.parsers, prompt.messages is not None):
            tail = self.text.decode(p.req.input_ids[-4:], skip_special_tokens=False)
            split = tool_rpc.ResponseSplit(tool_plan, self.parsers, tail)
        stream = self.generator.stream(p, rid, trace)
        try:
            async for chunk in stream:
                resp = _response(rid, chunk)
                if split is not None:
                    split.apply(chunk, resp)
                yield resp
        finally:
            await stream.aclose()

    async def Score(self, request: pb.ScoreRequest, context) -> pb.ScoreResponse:
        rid = request.request_id or uuid.uuid4().hex
        trace = Trace.incoming(_traceparent(context))
        stage("received", rid, trace_id=trace.trace_id, rpc="Score")
        if len(request.request_id) > validation.MAX_REQUEST_ID or len(request.cache_salt) > validation.MAX_CACHE_SALT:
            raise InvalidArgument("request_id and cache_salt must have at most 256 characters")
        prompt_len, seqs = self.scorer.sequences(_prompt(request), list(request.continuations), self.client.model_info())
        scores = await self.scorer.score(rid, seqs, request.cache_salt, trace.traceparent)
        stage("sent", rid, trace_id=trace.trace_id, continuations=len(scores))
        return pb.ScoreResponse(request_id=rid, prompt_tokens=prompt_len, scores=[
            pb.ContinuationScore(tokens=[pb.TokenLogprob(token_id=t, logprob=lp) for t, lp in zip(s.token_ids, s.logprobs)],
                                 logprob_sum=s.total, logprob_mean=s.mean, cached_tokens=s.cached_tokens)
            for s in scores])

    async def Tokenize(self, request: pb.TokenizeRequest, context) -> pb.TokenizeResponse:
        kind = request.WhichOneof("input")
        if kind == "text":
            prompt = Prompt(text=request.text)
        elif kind == "chat":
            add_gen = request.chat.add_generation_prompt if request.chat.HasField("add_generation_prompt") else True
            prompt = Prompt(messages=_messages(request.chat), add_generation_prompt=add_gen)
        else:
            raise InvalidArgument("one of text or chat is required")
        add = request.add_special_tokens if request.HasField("add_special_tokens") else True
        ids = tokens.tokenize(self.text, prompt, self.client.model_info(), add_special_tokens=add)
        return pb.TokenizeResponse(token_ids=ids, tokens=self.text.tokens(ids))

    async def Detokenize(self, request: pb.DetokenizeRequest, context) -> pb.DetokenizeResponse:
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        return pb.DetokenizeResponse(text=tokens.detokenize(self.text, list(request.token_ids), skip))

    async def GetModelInfo(self, request, context) -> pb.GetModelInfoResponse:
        i = self.client.model_info()
        return pb.GetModelInfoResponse(model=i.model, architecture=i.architecture, vocab_size=i.vocab_size,
                                       context_length=i.context_length, kv_pool_tokens=i.pool_size,
                                       max_running_requests=i.max_running_requests, device=i.device,
                                       dtype=i.dtype, eos_token_ids=i.eos_token_ids,
                                       data_parallel_size=len(self.client.links))

    async def Abort(self, request: pb.AbortRequest, context) -> pb.AbortResponse:
        if not request.request_id:
            raise InvalidArgument("request_id must not be empty")
        found = self.client.in_flight(request.request_id)
        if found:
            self.client.abort(request.request_id)
        return pb.AbortResponse(found=found)

    async def OpenSession(self, request: pb.OpenSessionRequest, context) -> pb.OpenSessionResponse:
        self.client.model_info()
        v = await self.sessions.open(request.ttl_seconds if request.HasField("ttl_seconds") else None,
                                     request.capacity if request.HasField("capacity") else None, request.cache_salt)
        stage("session_opened", v.session_id, capacity=v.capacity, ttl_s=v.ttl_s)
        return pb.OpenSessionResponse(session_id=v.session_id, ttl_seconds=int(v.ttl_s), capacity=v.capacity)

    async def CloseSession(self, request: pb.CloseSessionRequest, context) -> pb.CloseSessionResponse:
        self.client.model_info()
        tokens = await self.sessions.close(request.session_id)
        stage("session_closed", request.session_id, tokens=tokens)
        return pb.CloseSessionResponse(tokens=tokens)

    async def PinPrefix(self, request: pb.PinPrefixRequest, context) -> pb.PinPrefixResponse:
        info = self.client.model_info()
        if request.WhichOneof("input") is None:
            raise InvalidArgument("one of text, token_ids or chat is required")
        ids = validation.input_ids(_prompt(request, add_default=False), self.text, info)
        trace = Trace.incoming(_traceparent(context))
        pin_id, cached = await self.sessions.pin(ids, request.ttl_seconds if request.HasField("ttl_seconds") else None,
                                                 request.cache_salt, trace.traceparent)
        stage("pinned", pin_id, trace_id=trace.trace_id, tokens=len(ids), cached_tokens=cached)
        return pb.PinPrefixResponse(pin_id=pin_id, tokens=len(ids), cached_tokens=cached)

    async def UnpinPrefix(self, request: pb.UnpinPrefixRequest, context) -> pb.UnpinPrefixResponse:
        self.client.model_info()
        tokens = await self.sessions.unpin(request.pin_id)
        stage("unpinned", request.pin_id, tokens=tokens)
        return pb.UnpinPrefixResponse(tokens=tokens)

    async def GetLoad(self, request, context) -> pb.GetLoadResponse:
        self.client.model_info()
        loads = await self.client.loads()
        resp = _load(total_load(loads))
        if len(loads) > 1:
            resp.groups.extend(_load(x) for x in loads)
        return resp


def _load(load: Load) -> pb.GetLoadResponse:
    return pb.GetLoadResponse(num_running_requests=load.num_running, num_waiting_requests=load.num_waiting,
                              kv_free_tokens=load.kv_free, kv_used_tokens=load.kv_used, kv_pool_tokens=load.kv_pool,
                              steps=load.steps, prefill_computed_tokens=load.prefill_computed_tokens,
                              prefill_cached_tokens=load.prefill_cached_tokens, decode_tokens=load.decode_tokens,
                              retractions=load.retractions, evicted_tokens=load.evicted_tokens,
                              kv_evictable_tokens=load.kv_evictable, jump_forward_tokens=load.jump_forward_tokens,
                              preemptions=load.preemptions, shed_requests=load.shed, num_sessions=load.num_sessions,
                              session_tokens=load.session_tokens, num_pinned_prefixes=load.num_pins,
                              pinned_tokens=load.pinned_tokens, max_pinned_tokens=load.max_pinned_tokens,
                              **{f: getattr(load, f) for f in TIER_FIELDS})


TIER_FIELDS = ("host_cached_tokens", "disk_cached_tokens", "host_pool_tokens", "host_used_tokens",
               "disk_capacity_bytes", "disk_used_bytes", "tier_stored_tokens", "tier_loaded_tokens",
               "disk_written_tokens", "disk_read_tokens", "tier_failures")  # (same names in Load and the proto)
