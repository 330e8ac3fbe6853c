"""``POST /v1/responses`` (OpenAI's Responses API) on the chat path: ``instructions`` + ``input``
become chat messages rendered by the model's template, the generation runs as a chat completion's
does, and the answer is a ``response`` object, or streamed as its events (``response.created``,
``response.output_item.added``, ``response.output_text.delta`` … ``response.completed``).

Function tools take the chat route's tool calling (``services/tokenizer/tools``): the tools go to
the chat template, ``tool_choice`` required / named is grammar-enforced, and the output goes through
the tool-call parser, whose calls become ``function_call`` items (``responses_output.py``, with their
``response.function_call_arguments.*`` events). ``function_call`` / ``function_call_output`` input
items are the history's tool turns."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request, Response
from fastapi.responses import StreamingResponse

from shared.errors import InvalidArgument
from shared.logging import stage
from shared.messages.common import Constraint, FinishReason
from shared.messages.to_tokenizer import ModelInfo
from services.tokenizer import validation
from services.tokenizer.generation import Chunk
from services.tokenizer.http import errors
from services.tokenizer.http import responses_api as rapi
from services.tokenizer.http.responses_output import Event, Output
from services.tokenizer.http.streams import merge, unless_disconnected
from services.tokenizer.text import ChatExtras, Message
from services.tokenizer.chat_output import ChatOutput
from services.tokenizer.tools import request as tools_request
from services.tokenizer.tools.request import Function, ToolPlan
from services.tokenizer.validation import Prompt, SamplingRequest

_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
_TEXT_PARTS = frozenset({"input_text", "output_text", "text"})


def _content(item: dict[str, Any], name: str) -> str:
    content = item.get("content")
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidArgument(f"{name}.content is required: a string or a list of input_text parts")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise InvalidArgument(f"{name}.content[{j}]: only text parts (input_text, output_text) are supported, "
                                  f"got {kind!r}")
        texts.append(part["text"])
    return "\n".join(texts)


def messages(body: rapi.ResponseRequest) -> list[Message]:
    """``instructions`` (a system message) and ``input`` as chat messages."""
    out = [Message("system", body.instructions)] if body.instructions else []
    if isinstance(body.input, str):
        return out + [Message("user", body.input)]
    for i, item in enumerate(body.input):
        name, kind = f"input[{i}]", item.get("type", "message")
        if kind == "reasoning":  # a previous answer's reasoning summary: not part of the prompt
            continue
        if kind == "function_call":
            call = tools_request.history_calls([(_str(item, "call_id", name), _str(item, "name", name),
                                                 _str(item, "arguments", name))], name)
            if out and out[-1].role == "assistant" and out[-1].tool_calls and not out[-1].content:
                out[-1] = dataclasses.replace(out[-1], tool_calls=out[-1].tool_calls + call)  # (parallel calls)
            else:
                out.append(Message("assistant", "", tool_calls=call))
            continue
        if kind == "function_call_output":
            out.append(Message("tool", _str(item, "output", name), tool_call_id=_str(item, "call_id", name)))
            continue
        if kind != "message":
            raise InvalidArgument(f"{name}.type {kind!r} is not supported (message, function_call, "
                                  "function_call_output)")
        role = item.get("role")
        if role not in _ROLES:
            raise InvalidArgument(f"{name}.role must be one of user, system, developer, assistant, got {role!r}")
        out.append(Message(_ROLES[role], _content(item, name)))
    if not out:
        raise InvalidArgument("input must not be empty")
    return out


def _str(item: dict[str, Any], key: str, name: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise InvalidArgument(f"{name}.{key} is required (a string)")
    return value


def _constraint(body: rapi.ResponseRequest) -> Constraint | None:
    fmt = body.text.format if body.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return Constraint("json_object")
    if fmt.schema_ is None:
        raise InvalidArgument("text.format.schema is required when type is json_schema")
    return Constraint("json_schema", value=json.dumps(fmt.schema_))


def tool_plan(body: rapi.ResponseRequest, server_parser: str | None, constraint: Constraint | None) -> ToolPlan:
    functions = [Function(t.name, t.description, t.parameters, bool(t.strict)) for t in body.tools or ()]
    choice, named = body.tool_choice, None
    if isinstance(choice, rapi.NamedFunction):
        choice, named = "function", choice.name
    return tools_request.plan(functions, choice, named, body.parallel_tool_calls, server_parser,
                              other_constraint=constraint is not None)


def convert_request(body: rapi.ResponseRequest, server_parser: str | None = None,
                    ) -> tuple[Prompt, SamplingRequest, Constraint | None, ToolPlan]:
    """The chat prompt (with the tools for the template), sampling, the constraint (the output
    format's, or the one enforcing ``tool_choice``) and the tool plan (its parser reads the output)."""
    sampling = SamplingRequest(max_tokens=body.max_output_tokens, temperature=body.temperature, top_p=body.top_p,
                               seed=body.seed)
    constraint = _constraint(body)
    plan = tool_plan(body, server_parser, constraint)
    extras = ChatExtras(plan.tools) if plan.tools else None
    return Prompt(messages=messages(body), extras=extras), sampling, plan.constraint or constraint, plan


def _usage(c: Chunk | None) -> rapi.ResponseUsage | None:
    if c is None or c.usage is None:
        return None
    u = c.usage
    return rapi.ResponseUsage(input_tokens=u.prompt_tokens, output_tokens=u.completion_tokens,
                              total_tokens=u.prompt_tokens + u.completion_tokens,
                              input_tokens_details=rapi.InputTokensDetails(cached_tokens=u.cached_tokens))


class _Answer:
    """The response object being built (the same fields and items streamed and not)."""

    def __init__(self, rid: str, body: rapi.ResponseRequest, model: str, split: ChatOutput | None) -> None:
        self.body, self.model = body, model
        self.id = f"resp_{rid}"
        self.created = int(time.time())
        self.output = Output(rid, split)
        self.last: Chunk | None = None

    def add(self, c: Chunk) -> list[Event]:
        if c.finish:
            self.last = c
        return self.output.feed(c.text) if c.text else []

    @property
    def cut(self) -> bool:
        return self.last is not None and self.last.finish is FinishReason.LENGTH

    def finish(self) -> list[Event]:
        return self.output.finish("incomplete" if self.cut else "completed")

    def response(self, done: bool) -> rapi.Response:
        b = self.body
        status = "in_progress" if not done else "incomplete" if self.cut else "completed"
        fmt = b.text.format.model_dump(by_alias=True, exclude_none=True) if b.text and b.text.format else None
        return rapi.Response(
            id=self.id, created_at=self.created, status=status, model=self.model,
            output=self.output.items(status) if done else [], usage=_usage(self.last) if done else None,
            incomplete_details=rapi.IncompleteDetails(reason="max_output_tokens") if done and self.cut else None,
            instructions=b.instructions, max_output_tokens=b.max_output_tokens,
            parallel_tool_calls=b.parallel_tool_calls is not False, temperature=b.temperature, top_p=b.top_p,
            text={"format": fmt or {"type": "text"}}, user=b.user,
            tools=[t.model_dump(exclude_none=True) for t in b.tools or ()],
            tool_choice=b.tool_choice.model_dump() if isinstance(b.tool_choice, rapi.NamedFunction) else (
                b.tool_choice or ("auto" if b.tools else "none")),
            metadata=b.metadata or {}, reasoning=b.reasoning, store=False)


class _Events:
    """Server-sent events of one streamed response, numbered."""

    def __init__(self) -> None:
        self.seq = 0

    def __call__(self, type_: str, **data: Any) -> str:
        payload = {"type": type_, "sequence_number": self.seq, **data}
        self.seq += 1
        return f"event: {type_}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n"


async def create(front, request: Request, body: rapi.ResponseRequest, info: ModelInfo, rid: str) -> Response:
    """Answer one ``POST /v1/responses`` (``front``: the app's ``Frontend``)."""
    prompt, sampling, constraint, plan = convert_request(body, front.parsers.tool)

    prepared = validation.prepare(prompt, sampling, front.text, info, request_id=rid, constraint=constraint)
    trace = request.state.trace
    stage("tokenized", rid, trace_id=trace.trace_id, prompt_tokens=len(prepared.req.input_ids), n=1)
    reasoning = front.parsers.reasoning
    tail = front.text.decode(prepared.req.input_ids[-4:], skip_special_tokens=False) if reasoning else ""
    split = ChatOutput(plan.parser, reasoning, tail) if plan.parser or reasoning else None
    outputs = front._tracked([rid], merge([front.generator.stream(prepared, rid, trace)]))
    answer = _Answer(rid, body, info.model, split)
    headers = {"X-Request-Id": rid}
    if not body.stream:
        async def collect() -> rapi.Response:
            try:
                async for _, c in outputs:
                    answer.add(c)
            finally:
                await outputs.aclose()
            answer.finish()
            return answer.response(done=True)

        result = await unless_disconnected(request, collect())
        return Response(result.model_dump_json(), media_type="application/json", headers=headers)
    try:  # wait for the first output, so that errors before it still get their HTTP status
        first = await unless_disconnected(request, anext(outputs))
    except BaseException:
        await outputs.aclose()
        raise
    return StreamingResponse(_stream(answer, outputs, first[1]), media_type="text/event-stream",
                             headers=headers | {"Cache-Control": "no-cache"})


async def _stream(answer: _Answer, outputs: AsyncIterator[tuple[int, Chunk]], first: Chunk) -> AsyncIterator[str]:
    ev = _Events()
    try:
        yield ev("response.created", response=answer.response(done=False).model_dump())
        yield ev("response.in_progress", response=answer.response(done=False).model_dump())
        c: Chunk | None = first
        while c is not None:
            for kind, fields in answer.add(c):
                yield ev(kind, **fields)
            nxt = await anext(outputs, None)
            c = nxt[1] if nxt is not None else None
        for kind, fields in answer.finish():
            yield ev(kind, **fields)
        done = answer.response(done=True)
        yield ev("response.completed" if done.status == "completed" else "response.incomplete",
                 response=done.model_dump())
    except Exception as e:  # the status line is gone: the error travels as an event
        yield errors.sse_error(e)
    finally:
        await outputs.aclose()
