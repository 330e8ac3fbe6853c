"""Tool calling and reasoning output on the chat route: the request's tools → a ``ToolPlan``, its
history's tool turns → template fields, and ``ToolChatFormat``: chat answers and stream deltas with
``tool_calls``, ``reasoning_content`` and finish_reason ``tool_calls``."""

from __future__ import annotations

from collections.abc import Callable

from shared.messages.common import Constraint
from services.tokenizer.chat_output import ChatOutput, OutputDelta, whole
from services.tokenizer.generation import Chunk
from services.tokenizer.http import protocol as api
from services.tokenizer.http.convert import ChatFormat, ChoiceAcc, TokenTexts, stop_reason
from services.tokenizer.http.tool_protocol import FunctionCall, FunctionCallDelta, NamedToolChoice, ToolCall, ToolCallChunk
from services.tokenizer.text import ChatExtras
from services.tokenizer.tools import request as tools_request
from services.tokenizer.tools.request import Function, ToolPlan


def plan(body: api.ChatCompletionRequest, server_parser: str | None, constraint: Constraint | None) -> ToolPlan:
    functions = [Function(t.function.name, t.function.description, t.function.parameters, bool(t.function.strict))
                 for t in body.tools or ()]
    choice, named = body.tool_choice, None
    if isinstance(choice, NamedToolChoice):
        choice, named = "function", choice.function.name
    return tools_request.plan(functions, choice, named, body.parallel_tool_calls, server_parser,
                              other_constraint=constraint is not None)


def extras(body: api.ChatCompletionRequest, p: ToolPlan) -> ChatExtras | None:
    kwargs = tools_request.template_kwargs(body.chat_template_kwargs)
    return ChatExtras(p.tools, kwargs) if p.tools or kwargs else None


def _chunks(delta: OutputDelta) -> list[ToolCallChunk] | None:
    if not delta.tool_calls:
        return None
    return [ToolCallChunk(index=d.index, id=d.id, type="function" if d.id else None,
                          function=FunctionCallDelta(name=d.name, arguments=d.arguments))
            for d in delta.tool_calls]


class ToolChatFormat(ChatFormat):
    """``ChatFormat`` whose choices' text goes through a ``ChatOutput`` (one per choice)."""

    def __init__(self, tokens: TokenTexts, logprobs: bool, output: Callable[[], ChatOutput]) -> None:
        super().__init__(tokens, logprobs)
        self._new_output = output
        self._outputs: dict[int, ChatOutput] = {}

    def _output(self, index: int) -> ChatOutput:
        if index not in self._outputs:
            self._outputs[index] = self._new_output()
        return self._outputs[index]

    @staticmethod
    def _finish(finish: str | None, calls: int) -> str | None:
        return "tool_calls" if finish == "stop" and calls else finish

    def delta(self, index: int, c: Chunk) -> api.ChatChunkChoice | None:
        out = self._output(index)
        d = out.feed(c.text) if c.text else OutputDelta()
        if c.finish:
            last = out.finish()
            d = OutputDelta(d.content + last.content, d.reasoning + last.reasoning, d.tool_calls + last.tool_calls)
        if not (d or c.finish or c.logprobs):
            return None
        delta = api.Delta(content=d.content or None, reasoning_content=d.reasoning or None,
                          reasoning=d.reasoning or None, tool_calls=_chunks(d))
        return api.ChatChunkChoice(index=index, delta=delta,
                                   logprobs=self._logprobs(c.logprobs) if c.logprobs else None,
                                   finish_reason=self._finish(c.finish, out.calls) if c.finish else None,
                                   stop_reason=stop_reason(c))

    def response(self, rid: str, created: int, model: str, choices: dict[int, ChoiceAcc],
                 usage: api.Usage) -> api.ChatCompletion:
        out = []
        for i, a in sorted(choices.items()):
            m = whole(self._output(i), "".join(a.texts))
            calls = [ToolCall(id=cid, function=FunctionCall(name=name, arguments=args))
                     for cid, name, args in m.tool_calls] or None
            msg = api.AssistantMessage(content=m.content, tool_calls=calls, reasoning_content=m.reasoning,
                                       reasoning=m.reasoning)
            finish = a.last.finish if a.last else None
            out.append(api.ChatChoice(index=i, message=msg, logprobs=self._logprobs(a.logprobs),
                                      finish_reason=self._finish(finish, len(m.tool_calls)),
                                      stop_reason=stop_reason(a.last) if a.last else None))
        return api.ChatCompletion(id=rid, created=created, model=model, usage=usage, choices=out)


def chat_format(tokens: TokenTexts, logprobs: bool, p: ToolPlan, reasoning: str | None,
                prompt_tail: str) -> ChatFormat:
    """The chat answer's format: plain, or split into content / reasoning / calls."""
    if p.parser is None and reasoning is None:
        return ChatFormat(tokens, logprobs)
    return ToolChatFormat(tokens, logprobs, lambda: ChatOutput(p.parser, reasoning, prompt_tail))
