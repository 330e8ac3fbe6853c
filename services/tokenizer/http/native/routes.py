"""SGLang's native HTTP routes on a tokenizer replica's HTTP port (what SGLang's frontend language
``RuntimeEndpoint``, its evaluation scripts and RL rollout clients call).

``POST /generate`` takes the OpenAI routes' path: body → ``Prompt`` + ``SamplingRequest`` per prompt
(convert.py) → ``validation.prepare`` → ``Generator.stream`` (stage lines, the trace, metrics, the
API key, priority, sessions), merged; outputs are shaped by results.py. Streams are server-sent
events, each with an output's text and ids so far and its ``meta_info``, ending in ``data: [DONE]``.
Errors are the app's ``{"error": {"message", ...}}`` bodies with SGLang's status codes (400 for bad
input, naming the field).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from shared.errors import InvalidArgument, Unavailable
from shared.logging import stage
from shared.messages.to_tokenizer import SessionView
from shared.tracing import Trace
from services.tokenizer import validation
from services.tokenizer.flush import Flusher
from services.tokenizer.generation import Chunk, Generator
from services.tokenizer.http import errors
from services.tokenizer.http.native import convert, info
from services.tokenizer.http.native import protocol as api
from services.tokenizer.http.native.results import Output
from services.tokenizer.http.streams import merge, unless_disconnected
from services.tokenizer.validation import Prepared, Prompt, SamplingRequest

if TYPE_CHECKING:
    from services.tokenizer.http.app import Frontend

HEALTH_TIMEOUT_S = 20.0
# SGLang endpoints with no meaning here: 501 naming them, as http/unserved.py answers OpenAI's (/classify is there)
NOT_SERVED = {
    "/encode": "embeddings",
    "/update_weights_from_disk": "weight updates", "/update_weights_from_tensor": "weight updates",
    "/update_weights_from_distributed": "weight updates", "/init_weights_update_group": "weight updates",
    "/get_weights_by_name": "weight inspection", "/release_memory_occupation": "memory release",
    "/resume_memory_occupation": "memory release", "/load_lora_adapter": "LoRA adapters",
    "/unload_lora_adapter": "LoRA adapters", "/start_profile": "profiling (banyan bench and --metrics-port)",
    "/stop_profile": "profiling (banyan bench and --metrics-port)", "/start_expert_distribution_record": "MoE",
    "/stop_expert_distribution_record": "MoE", "/dump_expert_distribution_record": "MoE",
    "/concate_and_append_request": "KV concatenation of requests", "/set_internal_state": "internal state changes",
    "/configure_logging": "logging changes at run time (--log-format at start-up)",
    "/pause_generation": "pausing", "/continue_generation": "pausing", "/slow_down": "slow-down",
}


def _event(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


class Native:
    """The native API's state beside the OpenAI routes' ``Frontend`` (shared generator, sessions,
    in-flight set)."""

    def __init__(self, front: Frontend) -> None:
        self.front = front
        self.flusher = Flusher.for_client(front.client)
        self.probe = Generator(front.text, front.client)  # /health_generate's (not in the request metrics)

    # ---- /generate ---------------------------------------------------------------------------
    def prepare(self, item: convert.Item, rid: str, priority: int, session: SessionView | None) -> Prepared:
        text, vinfo = self.front.text, self.front.model()
        prompt, sampling = item.prompt, item.sampling
        try:
            if item.logprob_start >= 0:
                if session is not None:
                    raise InvalidArgument("logprob_start_len >= 0 is not supported with session_params")
                ids = validation.input_ids(prompt, text, vinfo)
                if item.logprob_start > len(ids):
                    raise InvalidArgument(f"logprob_start_len={item.logprob_start} is higher than the number of "
                                          f"input tokens ({len(ids)}): use a smaller logprob_start_len")
                prompt, sampling = Prompt(token_ids=ids), _prompt_logprobs(sampling, item, len(ids))
            return validation.prepare(prompt, sampling, text, vinfo, request_id=rid, prefix="sampling_params.",
                                      constraint=item.constraint, priority=priority, session=session)
        except InvalidArgument as e:
            raise convert.sglang_names(e) from None

    async def generate(self, body: api.GenerateRequest, request: Request) -> Response:
        from services.tokenizer.http.app import request_priority  # (app.py imports this module)

        front = self.front
        front.model()
        base = request.headers.get("x-request-id") or uuid.uuid4().hex
        trace = Trace.incoming(request.headers.get("traceparent"))
        received = time.monotonic()
        items, batch = convert.items(body)
        rids = [it.rid or (base if len(items) == 1 else f"{base}-{i}") for i, it in enumerate(items)]
        for r in rids:
            stage("received", r, trace_id=trace.trace_id, api="generate")
        priority = request_priority(request, body.priority)
        session = await self._session(body, items, priority)
        group = self._group(body.data_parallel_rank)
        prepared = [self.prepare(it, r, priority, session) for it, r in zip(items, rids)]
        n = prepared[0].req.n
        if any(p.req.n != n for p in prepared):
            raise InvalidArgument("sampling_params.n must be the same for every prompt of a batch")
        for r, p in zip(rids, prepared):
            stage("tokenized", r, trace_id=trace.trace_id, prompt_tokens=len(p.req.input_ids), n=p.req.n)
        shared: list[list] = [[] for _ in items]  # per prompt: its prompt log-probs once they came
        outs = [Output(it, p, r, front.token_texts, body.return_text_in_logprobs, shared[i])
                for i, (it, p, r) in enumerate(zip(items, prepared, rids)) for _ in range(n)]
        streams = [front.generator.stream(p, r, trace, group) for p, r in zip(prepared, rids)]
        outputs = self._tracked(rids, merge(streams))
        listed = batch or n > 1
        headers = {"X-Request-Id": rids[0]}
        if not body.stream:
            await unless_disconnected(request, self._collect(outputs, outs, n))
            bodies = [o.body(received) for o in outs]
            return JSONResponse(bodies if listed else bodies[0], headers=headers)
        try:  # the first output before the status line: errors before it still get their HTTP status
            first = await unless_disconnected(request, anext(outputs))
        except BaseException:
            await outputs.aclose()
            raise
        events = self._events(outputs, first, outs, n, received, listed)
        return StreamingResponse(events, media_type="text/event-stream",
                                 headers=headers | {"Cache-Control": "no-cache"})

    async def _session(self, body: api.GenerateRequest, items: list[convert.Item], priority: int) -> SessionView | None:
        sp = body.session_params
        if sp is None:
            return None
        convert.refuse_unsupported(sp.model_extra, {}, frozenset(), "session_params.")
        for name in ("offset", "replace", "drop_previous_output"):
            if getattr(sp, name) not in (None, False, -1):
                raise InvalidArgument(f"session_params.{name} is not supported (a turn continues its parent whole)")
        if len(items) > 1:
            raise InvalidArgument("session_params takes one prompt (a session turn continues one conversation)")
        it, vinfo = items[0], self.front.model()
        try:
            validation.precheck(it.prompt, it.sampling, vinfo, priority=priority, prefix="sampling_params.")
        except InvalidArgument as e:
            raise convert.sglang_names(e) from None
        return await self.front.sessions.view(sp.id, sp.rid or "")

    def _group(self, rank: int | None) -> int | None:
        if rank is None:
            return None
        groups = len(self.front.client.links)
        if not 0 <= rank < groups:
            raise InvalidArgument(f"data_parallel_rank must be in [0, {groups}), got {rank}")
        return rank

    async def _tracked(self, rids: list[str], outputs: AsyncIterator[tuple[int, Chunk]]):
        self.front.in_flight.update(rids)
        try:
            async for item in outputs:
                yield item
        finally:
            self.front.in_flight.difference_update(rids)
            await outputs.aclose()  # type: ignore[attr-defined]

    @staticmethod
    async def _collect(outputs, outs: list[Output], n: int) -> None:
        try:
            async for i, c in outputs:
                outs[i * n + c.index].add(c)
        finally:
            await outputs.aclose()

    @staticmethod
    async def _events(outputs, first, outs: list[Output], n: int, received: float, listed: bool) -> AsyncIterator[str]:
        try:
            item = first
            while item is not None:
                i, c = item
                k = i * n + c.index
                outs[k].add(c)
                yield _event(outs[k].body(received, k if listed else None))
                item = await anext(outputs, None)
        except Exception as e:  # the status line is gone: the error travels as an event
            yield errors.sse_error(e)
        finally:
            await outputs.aclose()
        yield "data: [DONE]\n\n"

    # ---- health ------------------------------------------------------------------------------
    async def health_generate(self) -> Response:
        """200 once a one-token generation came back (the whole path works), else 503."""
        front = self.front
        if not front.client.ready.is_set() or front.client.closing:
            return Response(status_code=503)
        try:
            vinfo = front.model()
            p = validation.prepare(Prompt(token_ids=[0]), SamplingRequest(max_tokens=1, temperature=0.0),
                                   front.text, vinfo, request_id=f"health-{uuid.uuid4().hex}")
            stream = self.probe.stream(p, p.req.rid)

            async def run() -> None:
                try:
                    async for _ in stream:
                        pass
                finally:
                    await stream.aclose()

            await asyncio.wait_for(run(), HEALTH_TIMEOUT_S)
        except (TimeoutError, Unavailable):
            return Response(status_code=503)
        return Response(status_code=200)


def _prompt_logprobs(s: SamplingRequest, item: convert.Item, prompt_len: int) -> SamplingRequest:
    """Ask the engine for the prompt log-probs SGLang returns: positions after ``logprob_start_len``
    (the entry at the start position has none)."""
    first = item.logprob_start + 1
    if first >= prompt_len:
        return s
    return dataclasses.replace(s, prompt_logprobs_start=first, prompt_top_logprobs=item.top_logprobs or None)


def install(app: FastAPI, front: Frontend) -> Native:
    """Add the native routes to the OpenAI app (same middleware, errors and generator)."""
    native = Native(front)
    responses = {s: {"description": "an error: {\"error\": {\"message\": ...}}"} for s in (400, 401, 404, 503)}

    @app.api_route("/generate", methods=["POST", "PUT"], responses=responses, tags=["SGLang native"])
    async def generate(body: api.GenerateRequest, request: Request) -> Response:
        return await native.generate(body, request)

    @app.get("/get_model_info", tags=["SGLang native"])
    @app.get("/model_info", tags=["SGLang native"])
    async def model_info() -> dict:
        return info.model_info(front)

    @app.get("/server_info", tags=["SGLang native"])
    @app.get("/get_server_info", tags=["SGLang native"])
    async def server_info() -> dict:
        return await info.server_info(front)

    @app.api_route("/flush_cache", methods=["GET", "POST"], tags=["SGLang native"])
    async def flush_cache(timeout: float = 0.0) -> Response:
        ok, message = await native.flusher.flush(timeout)
        if not ok:  # (e.g. requests in flight: SGLang's 400)
            raise errors.ApiError(400, f"the cache was not flushed: {message}", code="failed_precondition")
        return Response("Cache flushed.\n", media_type="text/plain")

    @app.post("/abort_request", tags=["SGLang native"])
    async def abort_request(body: api.AbortRequest) -> Response:
        convert.refuse_unsupported(body.model_extra, {}, frozenset({"finished_reason", "abort_message"}), "")
        if body.abort_all:
            front.abort_all()
        elif body.rid:
            front.client.abort(body.rid)
        else:
            raise InvalidArgument("give rid (the request to abort) or abort_all: true")
        return Response(status_code=200)

    @app.get("/health_generate", tags=["SGLang native"])
    async def health_generate() -> Response:
        return await native.health_generate()

    @app.api_route("/open_session", methods=["GET", "POST"], tags=["SGLang native"])
    async def open_session(body: api.OpenSessionRequest) -> JSONResponse:
        convert.refuse_unsupported(body.model_extra, {}, frozenset(), "")
        if body.session_id is not None:
            raise InvalidArgument("session_id is not supported: the server names the session")
        front.model()
        v = await front.sessions.open(None, None, "")
        stage("session_opened", v.session_id, capacity=v.capacity, ttl_s=v.ttl_s)
        return JSONResponse(v.session_id)

    @app.api_route("/close_session", methods=["GET", "POST"], tags=["SGLang native"])
    async def close_session(body: api.CloseSessionRequest) -> Response:
        front.model()
        tokens = await front.sessions.close(body.session_id)
        stage("session_closed", body.session_id, tokens=tokens)
        return Response(status_code=200)

    for path, what in NOT_SERVED.items():
        def refuse(what: str = what, path: str = path) -> None:
            raise errors.ApiError(501, f"{path} is not supported: Banyan does not serve {what}",
                                  code="not_implemented")
        app.add_api_route(path, refuse, methods=["GET", "POST", "PUT"], include_in_schema=False)
    return native
