"""Tool calling and reasoning output on gRPC ``banyan.v1`` Generate: the request's tools, tool
choice and template variables → a ``ToolPlan``, its chat history's tool turns → template fields,
and each sample's text split into ``text`` (the answer), ``reasoning_text`` and ``tool_calls``."""

from __future__ import annotations

import json

from shared.errors import InvalidArgument
from shared.proto.banyan.v1 import generation_pb2 as pb
from services.tokenizer.chat_output import ChatOutput, OutputDelta, OutputParsers
from services.tokenizer.generation import Chunk
from services.tokenizer.text import ChatExtras
from services.tokenizer.tools import request as tools_request
from services.tokenizer.tools.request import Function, ToolPlan


def message_fields(m: pb.ChatMessage, i: int) -> dict:
    where = f"chat.messages[{i}]"
    out: dict = {}
    if m.tool_calls:
        out["tool_calls"] = tools_request.history_calls([(c.id, c.name, c.arguments) for c in m.tool_calls], where)
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    if m.reasoning_content:
        out["reasoning_content"] = m.reasoning_content
    return out


def _parameters(t: pb.Tool, i: int) -> dict | None:
    if not t.parameters:
        return None
    try:
        schema = json.loads(t.parameters)
    except json.JSONDecodeError as e:
        raise InvalidArgument(f"tools[{i}].parameters is not JSON: {e}") from None
    if not isinstance(schema, dict):
        raise InvalidArgument(f"tools[{i}].parameters must be a JSON schema object")
    return schema


def plan(req: pb.GenerateRequest, server_parser: str | None, has_constraint: bool) -> tuple[ToolPlan, ChatExtras | None]:
    chat = req.WhichOneof("input") == "chat"
    if not chat and (req.tools or req.tool_choice or req.tool_choice_function or req.chat_template_kwargs):
        raise InvalidArgument("tools, tool_choice and chat_template_kwargs need chat input")
    functions = [Function(t.name, t.description or None, _parameters(t, i), t.strict) for i, t in enumerate(req.tools)]
    choice = "function" if req.tool_choice_function else (req.tool_choice or None)
    parallel = req.parallel_tool_calls if req.HasField("parallel_tool_calls") else None
    p = tools_request.plan(functions, choice, req.tool_choice_function or None, parallel, server_parser,
                           other_constraint=has_constraint)
    kwargs: dict | None = None
    if req.chat_template_kwargs:
        try:
            kwargs = json.loads(req.chat_template_kwargs)
        except json.JSONDecodeError as e:
            raise InvalidArgument(f"chat_template_kwargs is not JSON: {e}") from None
        if not isinstance(kwargs, dict):
            raise InvalidArgument("chat_template_kwargs must be a JSON object")
    kw = tools_request.template_kwargs(kwargs)
    return p, (ChatExtras(p.tools, kw) if p.tools or kw else None)


class ResponseSplit:
    """Each sample's chunks through a ``ChatOutput`` (one per sample), into the response message."""

    def __init__(self, p: ToolPlan, parsers: OutputParsers, prompt_tail: str) -> None:
        self._p, self._parsers, self._tail = p, parsers, prompt_tail
        self._outputs: dict[int, ChatOutput] = {}

    @staticmethod
    def needed(p: ToolPlan, parsers: OutputParsers, chat: bool) -> bool:
        return p.parser is not None or (chat and parsers.reasoning is not None)

    def apply(self, c: Chunk, resp: pb.GenerateResponse) -> None:
        out = self._outputs.get(c.index)
        if out is None:
            out = self._outputs[c.index] = ChatOutput(self._p.parser, self._parsers.reasoning, self._tail)
        d = out.feed(c.text) if c.text else OutputDelta()
        if c.finish:
            last = out.finish()
            d = OutputDelta(d.content + last.content, d.reasoning + last.reasoning, d.tool_calls + last.tool_calls)
        resp.text, resp.reasoning_text = d.content, d.reasoning
        for t in d.tool_calls:
            resp.tool_calls.append(pb.ToolCallDelta(index=t.index, id=t.id or "", name=t.name or "",
                                                    arguments=t.arguments))
        if c.finish and resp.finish_reason == pb.FINISH_REASON_STOP and out.calls:
            resp.finish_reason = pb.FINISH_REASON_TOOL_CALLS
