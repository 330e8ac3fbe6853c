"""The OpenAI-compatible HTTP routes of a tokenizer replica.

Generation takes the gRPC front's path: request → ``Prompt`` + ``SamplingRequest`` (convert.py) →
``validation.prepare`` → ``Generator.stream``; only the JSON shapes differ. Streams are server-sent
events ending in ``data: [DONE]``; a client that disconnects (streaming or not) closes the stream,
which aborts the request downstream and frees its KV cache.
"""

from __future__ import annotations

import dataclasses
import re
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from shared.errors import InvalidArgument
from shared.logging import stage
from shared.messages.to_tokenizer import ModelInfo
from shared.tracing import Trace, Tracer
from services.tokenizer import tokens, validation
from services.tokenizer.auth import ApiKey
from services.tokenizer.generation import Chunk, Generator
from services.tokenizer.chat_output import OutputParsers
from services.tokenizer.http import chat_tools, convert, errors, native
from services.tokenizer.http.docs import install_docs
from services.tokenizer.http import responses, responses_api, scoring_out
from services.tokenizer.http import protocol as api
from services.tokenizer.http.middleware import Edge
from services.tokenizer.http.tokenizer_info import tokenizer_info
from services.tokenizer.http.streams import ClientGone, merge, unless_disconnected
from services.tokenizer.metrics import TokenizerMetrics
from services.tokenizer.scheduler_client import SchedulerClient
from services.tokenizer.sessions import SessionFront
from services.tokenizer.text import TextProcessor
from services.tokenizer.validation import Prepared, Prompt
from shared.messages.to_tokenizer import SessionView

CLIENT_CLOSED = 499  # nobody reads it; counted in the metrics like nginx does
_ERRORS = {s: {"model": api.ErrorResponse} for s in (400, 401, 404, 409, 413, 429, 500, 503)}
PRIORITY_HEADER = "x-banyan-priority"
_INT = re.compile(r"[+-]?[0-9]{1,12}")
_SSE = {200: {"content": {"text/event-stream": {"schema": {"type": "string"}}},
              "description": "JSON, or with stream=true server-sent events ending in `data: [DONE]`"}}
Format = convert.ChatFormat | convert.CompletionFormat
Outputs = AsyncGenerator[tuple[int, Chunk], None]  # (prompt position, chunk) of every prompt's stream


def _event(data: str) -> str:
    return f"data: {data}\n\n"


class Frontend:
    """What the routes share: the text processor, the generator and the model being served."""

    def __init__(self, text: TextProcessor, client: SchedulerClient, metrics: TokenizerMetrics | None = None,
                 tracer: Tracer | None = None) -> None:
        self.text, self.client = text, client
        self.generator = Generator(text, client, metrics, tracer)
        self.token_texts = convert.TokenTexts(text)
        self.created = int(time.time())
        self.in_flight: set[str] = set()  # request ids of the generations being answered
        self.aliases: frozenset[str] = frozenset()  # other names requests may give the model (--served-model-name)
        self.sessions = SessionFront(client)
        self.parsers = OutputParsers()  # --tool-call-parser, --reasoning-parser (set by the server)

    async def turn(self, request: Request, body: api.ChatCompletionRequest | api.CompletionRequest,
                   prompt: Prompt, sampling: validation.SamplingRequest, info: ModelInfo,
                   ) -> tuple[int, SessionView | None]:
        """The request's priority (body field or header) and, with ``session_id``, the session turn
        it continues (asked once the rest of the request is known to be valid)."""
        priority = request_priority(request, body.priority)
        if body.session_id is None:
            if body.session_parent is not None:
                raise InvalidArgument("session_parent needs session_id")
            return priority, None
        validation.precheck(prompt, sampling, info, cache_salt=body.cache_salt, priority=priority)
        return priority, await self.sessions.view(body.session_id, body.session_parent or "")

    def abort_all(self) -> None:
        """End every generation in flight with finish_reason "abort" (the shutdown grace ran out):
        each response still completes well-formed."""
        for rid in list(self.in_flight):
            self.client.abort(rid)

    def model(self, name: str = "") -> ModelInfo:
        """The served model's info; ``name`` must be empty, that model's name or an alias."""
        info = self.client.model_info()
        if name and name != info.model and name not in self.aliases:
            raise errors.ApiError(404, f"the model {name!r} does not exist: this server serves {info.model!r}",
                                  code="model_not_found", param="model")
        return info

    async def generate(self, request: Request, prepared: list[Prepared], rid: str, object_id: str, fmt: Format,
                       stream: bool, options: api.StreamOptions | None) -> Response:
        n = prepared[0].req.n
        trace: Trace = request.state.trace  # one trace for the HTTP request, a span per prompt
        rids = [rid] if len(prepared) == 1 else [f"{rid}-{i}" for i in range(len(prepared))]
        for r, p in zip(rids, prepared):
            stage("tokenized", r, trace_id=trace.trace_id, prompt_tokens=len(p.req.input_ids), n=p.req.n)
        streams = [self.generator.stream(p, r, trace) for p, r in zip(prepared, rids)]
        outputs = self._tracked(rids, merge(streams))
        created, model, headers = int(time.time()), self.model().model, {"X-Request-Id": rid}
        if not stream:
            result = await unless_disconnected(request, self._collect(outputs, n, fmt, object_id, created, model))
            return Response(result.model_dump_json(), media_type="application/json", headers=headers)
        try:  # wait for the first output, so that errors before it still get their HTTP status
            first = await unless_disconnected(request, anext(outputs))
        except BaseException:
            await outputs.aclose()
            raise
        running = convert.RunningUsage(p.prompt_tokens for p in prepared) if options and \
            options.continuous_usage_stats else None
        include_usage = options is not None and options.include_usage
        events = self._events(outputs, first, n, len(prepared) * n, fmt, object_id, created, model, include_usage,
                              running)
        return StreamingResponse(events, media_type="text/event-stream",
                                 headers=headers | {"Cache-Control": "no-cache"})

    async def _tracked(self, rids: list[str], outputs: Outputs) -> Outputs:
        self.in_flight.update(rids)
        try:
            async for item in outputs:
                yield item
        finally:
            self.in_flight.difference_update(rids)
            await outputs.aclose()

    async def _collect(self, outputs: Outputs, n: int, fmt: Format, object_id: str, created: int,
                       model: str) -> api.ChatCompletion | api.Completion:
        choices: dict[int, convert.ChoiceAcc] = {}
        usage = convert.UsageAcc()
        try:
            async for i, c in outputs:
                choices.setdefault(i * n + c.index, convert.ChoiceAcc()).add(c)
                if c.usage is not None:
                    usage.add(i, c.usage)
        finally:
            await outputs.aclose()
        return fmt.response(object_id, created, model, choices, usage.usage())

    async def _events(self, outputs: Outputs, first: tuple[int, Chunk] | None, n: int, num_choices: int, fmt: Format,
                      object_id: str, created: int, model: str, include_usage: bool,
                      running: convert.RunningUsage | None = None) -> AsyncIterator[str]:
        usage = convert.UsageAcc()
        try:
            opening = [c for c in (fmt.opening(i) for i in range(num_choices)) if c is not None]
            if opening:
                yield _event(fmt.chunk(object_id, created, model, opening, None))
            item = first
            while item is not None:
                i, c = item
                if c.usage is not None:
                    usage.add(i, c.usage)
                choice = fmt.delta(i * n + c.index, c)
                now = running.add(c) if running is not None else None  # usage so far on every chunk (vLLM's)
                if choice is not None:
                    yield _event(fmt.chunk(object_id, created, model, [choice], now))
                item = await anext(outputs, None)
            if include_usage:
                yield _event(fmt.chunk(object_id, created, model, [], usage.usage()))
        except Exception as e:  # the status line is gone: the error travels as an event
            yield errors.sse_error(e)
        finally:
            await outputs.aclose()
        yield "data: [DONE]\n\n"


def _completion_format(front: Frontend, body: api.CompletionRequest, prompts: list[Prompt]) -> Format:
    if not body.echo and body.prompt_logprobs is None:
        return convert.CompletionFormat(front.token_texts, body.logprobs is not None)
    scoring_out.check(body.stream, body.prompt_logprobs)
    echo = [scoring_out.EchoPrompt(p.text if p.text is not None else front.text.decode(
        p.token_ids or [], skip_special_tokens=body.skip_special_tokens)) for p in prompts] if body.echo else None
    return scoring_out.ScoringCompletionFormat(front.token_texts, body.logprobs, body.n or 1, echo,
                                               body.prompt_logprobs)


def request_priority(request: Request, body_value: int | None) -> int:
    """``priority`` from the body or the ``x-banyan-priority`` header (both: they must agree)."""
    raw = request.headers.get(PRIORITY_HEADER)
    header = None
    if raw is not None:
        if not _INT.fullmatch(raw.strip()):
            raise InvalidArgument(f"the {PRIORITY_HEADER} header must be an integer, got {raw[:40]!r}")
        header = validation.check_priority(int(raw), f"the {PRIORITY_HEADER} header")
    if body_value is not None and header is not None and body_value != header:
        raise InvalidArgument(f"priority {body_value} and the {PRIORITY_HEADER} header ({header}) disagree: give one")
    priority = body_value if body_value is not None else header or 0
    return validation.check_priority(priority)


def _request_id(request: Request, prefix: str) -> str:
    """The request id (X-Request-Id or a new one); the trace context (traceparent or a new one) goes
    to ``request.state.trace``."""
    rid = request.state.rid = request.headers.get("x-request-id") or uuid.uuid4().hex
    trace = request.state.trace = Trace.incoming(request.headers.get("traceparent"))
    stage("received", rid, trace_id=trace.trace_id, api=prefix)
    return rid


def create_app(text: TextProcessor, client: SchedulerClient, api_key: ApiKey, metrics: TokenizerMetrics,
               tracer: Tracer | None = None) -> FastAPI:
    app = FastAPI(title="Banyan", version="1", summary="OpenAI-compatible API of a Banyan tokenizer replica",
                  docs_url=None, redoc_url=None)
    install_docs(app)  # /docs with Swagger UI's assets served here, not from a CDN
    errors.install(app)
    app.add_middleware(Edge, api_key=api_key, metrics=metrics)
    front = Frontend(text, client, metrics, tracer)
    app.state.frontend = front

    @app.exception_handler(ClientGone)
    async def _gone(_req: Request, _exc: ClientGone) -> Response:
        return Response(status_code=CLIENT_CLOSED)

    @app.post("/v1/chat/completions", response_model=api.ChatCompletion, responses=_ERRORS | _SSE)
    async def chat_completions(body: api.ChatCompletionRequest, request: Request) -> Response:
        info = front.model(body.model)
        rid = _request_id(request, "chat")
        prompt, sampling, constraint = convert.chat_request(body)
        tool_plan = chat_tools.plan(body, front.parsers.tool, constraint)
        prompt = dataclasses.replace(prompt, extras=chat_tools.extras(body, tool_plan))
        constraint = tool_plan.constraint or constraint
        priority, session = await front.turn(request, body, prompt, sampling, info)
        p = validation.prepare(prompt, sampling, text, info, request_id=rid, cache_salt=body.cache_salt,
                               constraint=constraint, priority=priority, session=session)
        tail = text.decode(p.req.input_ids[-4:], skip_special_tokens=False) if front.parsers.reasoning else ""
        fmt = chat_tools.chat_format(front.token_texts, body.logprobs, tool_plan, front.parsers.reasoning, tail)
        if body.prompt_logprobs is not None:
            scoring_out.check(body.stream, body.prompt_logprobs)
            fmt = scoring_out.ScoringChatFormat(fmt, body.prompt_logprobs)  # type: ignore[assignment]
        return await front.generate(request, [p], rid, f"chatcmpl-{rid}", fmt, body.stream, body.stream_options)

    @app.post("/v1/completions", response_model=api.Completion, responses=_ERRORS | _SSE)
    async def completions(body: api.CompletionRequest, request: Request) -> Response:
        info = front.model(body.model)
        rid = _request_id(request, "completions")
        prompts, sampling, constraint = convert.completion_request(body)
        if body.session_id is not None and len(prompts) > 1:
            raise InvalidArgument("session_id takes one prompt (a session turn continues one conversation)")
        priority, session = await front.turn(request, body, prompts[0], sampling, info)
        prepared = [validation.prepare(pr, sampling, text, info, request_id=rid, cache_salt=body.cache_salt,
                                       constraint=constraint, priority=priority, session=session) for pr in prompts]
        fmt = _completion_format(front, body, prompts)
        return await front.generate(request, prepared, rid, f"cmpl-{rid}", fmt, body.stream, body.stream_options)

    @app.post("/v1/responses", response_model=responses_api.Response, responses=_ERRORS | _SSE)
    async def create_response(body: responses_api.ResponseRequest, request: Request) -> Response:
        info = front.model(body.model)
        return await responses.create(front, request, body, info, _request_id(request, "responses"))

    @app.post("/v1/sessions", response_model=api.Session, responses=_ERRORS)
    async def open_session(body: api.SessionRequest) -> api.Session:
        front.model()
        v = await front.sessions.open(body.ttl_seconds, body.capacity, body.cache_salt)
        stage("session_opened", v.session_id, capacity=v.capacity, ttl_s=v.ttl_s)
        return api.Session(id=v.session_id, ttl_seconds=int(v.ttl_s), capacity=v.capacity)

    @app.delete("/v1/sessions/{session_id}", response_model=api.SessionDeleted, responses=_ERRORS)
    async def close_session(session_id: str) -> api.SessionDeleted:
        front.model()
        tokens = await front.sessions.close(session_id)
        stage("session_closed", session_id, tokens=tokens)
        return api.SessionDeleted(id=session_id, tokens=tokens)

    @app.get("/v1/models", response_model=api.ModelList, responses=_ERRORS)
    async def models() -> api.ModelList:
        info = front.model()
        return api.ModelList(data=[api.ModelCard(id=info.model, created=front.created,
                                                 max_model_len=info.context_length, vocab_size=info.vocab_size)])

    @app.get("/v1/models/{model:path}", response_model=api.ModelCard, responses=_ERRORS)
    async def model(model: str) -> api.ModelCard:
        info = front.model(model)
        return api.ModelCard(id=info.model, created=front.created, max_model_len=info.context_length,
                             vocab_size=info.vocab_size)

    @app.post("/tokenize", response_model=api.TokenizeResponse, responses=_ERRORS)
    async def tokenize(body: api.TokenizeRequest) -> api.TokenizeResponse:
        info = front.model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise InvalidArgument("give exactly one of prompt or messages")
        if body.prompt is not None:
            prompt = Prompt(text=body.prompt)
        else:
            prompt = Prompt(messages=convert.messages(body.messages or []),
                            add_generation_prompt=body.add_generation_prompt)
        ids = tokens.tokenize(text, prompt, info, body.add_special_tokens)
        return api.TokenizeResponse(tokens=ids, token_strs=text.tokens(ids), count=len(ids),
                                    max_model_len=info.context_length)

    @app.post("/detokenize", response_model=api.DetokenizeResponse, responses=_ERRORS)
    async def detokenize(body: api.DetokenizeRequest) -> api.DetokenizeResponse:
        front.model(body.model)
        return api.DetokenizeResponse(prompt=tokens.detokenize(text, body.tokens, body.skip_special_tokens, "tokens"))

    @app.get("/tokenizer_info", responses=_ERRORS)
    async def get_tokenizer_info() -> JSONResponse:
        front.model()
        return JSONResponse(tokenizer_info(text))

    @app.get("/health", responses={503: {"description": "the model is not loaded yet, or shutting down"}})
    async def health() -> JSONResponse:
        ok = client.ready.is_set() and not client.closing
        return JSONResponse({"status": "ok" if ok else "unavailable"}, status_code=200 if ok else 503)

    @app.get("/metrics", response_class=Response, responses={200: {"content": {"text/plain": {}}}})
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=metrics.content_type)

    native.install(app, front)  # SGLang's native API: /generate, /get_model_info, … (http/native/)
    return app
