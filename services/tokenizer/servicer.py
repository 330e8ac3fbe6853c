"""The public ``banyan.v1.GenerationService``: proto ↔ domain at the edge, streaming, cancel."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import grpc

from shared.errors import BY_WIRE_CODE, Internal, InvalidArgument, Unavailable
from shared.logging import stage
from shared.messages.to_tokenizer import ModelInfo, TokenOut
from shared.proto.banyan.v1 import generation_pb2 as pb
from shared.proto.banyan.v1 import generation_pb2_grpc as pb_grpc
from services.tokenizer import validation
from services.tokenizer.detokenizer import IncrementalDetokenizer
from services.tokenizer.scheduler_client import SchedulerClient
from services.tokenizer.text import TextProcessor

FINISH = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH, "abort": pb.FINISH_REASON_ABORT}


def _traceparent(context: grpc.aio.ServicerContext) -> str:
    for key, value in context.invocation_metadata() or ():
        if key == "traceparent":
            return value
    return ""


@dataclass
class _Branch:
    """Streaming state of one sample (n > 1 requests have several)."""

    detok: IncrementalDetokenizer
    generated: int = 0
    cached: int = 0
    done: bool = False


class GenerationServicer(pb_grpc.GenerationServiceServicer):
    def __init__(self, text: TextProcessor, client: SchedulerClient) -> None:
        self.text = text
        self.client = client

    def _info(self) -> ModelInfo:
        if self.client.info is None:
            raise Unavailable("the model is not loaded yet")
        return self.client.info

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        rid = request.request_id or uuid.uuid4().hex
        stage("received", rid)
        info = self._info()
        p = validation.prepare(request, self.text, info)
        stage("tokenized", rid, prompt_tokens=len(p.input_ids), n=p.n)
        queue = self.client.submit(rid, p.input_ids, p.params, p.n, p.cache_ns, _traceparent(context))
        branches = [_Branch(IncrementalDetokenizer(self.text.tokenizer, p.input_ids, p.skip_special_tokens, p.stop))
                    for _ in range(p.n)]
        live = p.n
        try:
            async for out in self.client.stream(queue):
                b = branches[out.index]
                if b.done:
                    continue
                if out.finish == "error":
                    live = 0
                    raise BY_WIRE_CODE.get(out.error_code, Internal)(out.error)
                b.generated += len(out.token_ids)
                b.cached = max(b.cached, out.cached_tokens)
                text = b.detok.push(out.token_ids)
                if b.detok.stopped or out.finish:
                    b.done, live = True, live - 1
                    if b.detok.stopped and not out.finish:
                        self.client.abort(rid, "stop", out.index)
                    usage = pb.Usage(prompt_tokens=len(p.input_ids), completion_tokens=b.generated,
                                     cached_tokens=b.cached)
                    yield self._final(rid, out, text, b.detok, p.params.stop_token_ids, usage)
                    if live == 0:
                        stage("sent", rid, completion_tokens=sum(x.generated for x in branches))
                        return
                    continue
                yield pb.GenerateResponse(request_id=rid, index=out.index, token_ids=out.token_ids, text=text)
        finally:
            self.client.release(rid)
            if live:  # the client went away (cancel, deadline, disconnect): free its KV
                self.client.abort(rid)
                stage("cancelled", rid, completion_tokens=sum(x.generated for x in branches))

    def _final(self, rid: str, out: TokenOut, text: str, detok: IncrementalDetokenizer,
               stop_ids: list[int], usage: pb.Usage) -> pb.GenerateResponse:
        resp = pb.GenerateResponse(request_id=rid, index=out.index, token_ids=out.token_ids, usage=usage)
        if detok.stopped:
            resp.finish_reason = pb.FINISH_REASON_STOP
            resp.matched_stop = detok.matched_stop
            resp.text = text
            return resp
        resp.text = text + detok.finish()
        resp.finish_reason = FINISH[out.finish]
        if out.finish == "stop" and out.token_ids and out.token_ids[-1] in stop_ids:
            resp.matched_stop_token_id = out.token_ids[-1]
        return resp

    async def Tokenize(self, request: pb.TokenizeRequest, context) -> pb.TokenizeResponse:
        kind = request.WhichOneof("input")
        if kind == "text":
            add = request.add_special_tokens if request.HasField("add_special_tokens") else True
            ids = self.text.encode(request.text, add_special_tokens=add)
        elif kind == "chat":
            add_gen = request.chat.add_generation_prompt if request.chat.HasField("add_generation_prompt") else True
            ids = self.text.encode_chat(validation.chat_messages(request.chat), add_gen)
        else:
            raise InvalidArgument("one of text or chat is required")
        return pb.TokenizeResponse(token_ids=ids, tokens=self.text.tokens(ids))

    async def Detokenize(self, request: pb.DetokenizeRequest, context) -> pb.DetokenizeResponse:
        vocab = len(self.text.tokenizer)
        bad = [t for t in request.token_ids if t >= vocab]
        if bad:
            raise InvalidArgument(f"token_ids: {bad[0]} is out of the vocabulary [0, {vocab})")
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        return pb.DetokenizeResponse(text=self.text.decode(list(request.token_ids), skip_special_tokens=skip))

    async def GetModelInfo(self, request, context) -> pb.GetModelInfoResponse:
        i = self._info()
        return pb.GetModelInfoResponse(model=i.model, architecture=i.architecture, vocab_size=i.vocab_size,
                                       context_length=i.context_length, kv_pool_tokens=i.pool_size,
                                       max_running_requests=i.max_running_requests, device=i.device,
                                       dtype=i.dtype, eos_token_ids=i.eos_token_ids)

    async def Abort(self, request: pb.AbortRequest, context) -> pb.AbortResponse:
        if not request.request_id:
            raise InvalidArgument("request_id must not be empty")
        found = self.client.in_flight(request.request_id)
        if found:
            self.client.abort(request.request_id)
        return pb.AbortResponse(found=found)

    async def GetLoad(self, request, context) -> pb.GetLoadResponse:
        self._info()
        load = await self.client.load()
        return pb.GetLoadResponse(num_running_requests=load.num_running, num_waiting_requests=load.num_waiting,
                                  kv_free_tokens=load.kv_free, kv_used_tokens=load.kv_used,
                                  kv_pool_tokens=load.kv_pool, steps=load.steps,
                                  prefill_computed_tokens=load.prefill_computed_tokens,
                                  prefill_cached_tokens=load.prefill_cached_tokens, decode_tokens=load.decode_tokens,
                                  retractions=load.retractions, evicted_tokens=load.evicted_tokens,
                                  kv_evictable_tokens=load.kv_evictable)
