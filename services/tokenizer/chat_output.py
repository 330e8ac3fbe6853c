"""A chat choice's generated text split into what the APIs answer: content, reasoning
(``--reasoning-parser``) and tool calls (the request's tool parser), incrementally. The reasoning
part comes first; calls are parsed only in the answer after it. Non-streamed answers are the same
split fed the whole text, so a stream's deltas concatenate to exactly the non-streamed message."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.tokenizer.reasoning import ReasoningParser
from services.tokenizer.tools import PARSERS, ToolCallDelta, resolve


@dataclass(frozen=True)
class OutputParsers:
    """The server's parsers: ``--tool-call-parser`` resolved against the chat template, ``--reasoning-parser``."""

    tool: str | None = None
    reasoning: str | None = None

    @classmethod
    def configured(cls, tool_flag: str, reasoning_flag: str, chat_template: str | None) -> OutputParsers:
        return cls(resolve(tool_flag, chat_template), reasoning_flag or None)


@dataclass
class OutputDelta:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)


@dataclass
class Message:
    """A whole choice: content (None when the answer is only calls), reasoning, calls."""

    content: str | None
    reasoning: str | None
    tool_calls: list[tuple[str, str, str]]  # (id, name, arguments)


class ChatOutput:
    def __init__(self, tool_parser: str | None, reasoning_parser: str | None, prompt_tail: str = "") -> None:
        self._tools = PARSERS[tool_parser]() if tool_parser else None
        self._reasoning = ReasoningParser(reasoning_parser, prompt_tail) if reasoning_parser else None
        self.calls = 0

    def feed(self, text: str) -> OutputDelta:
        return self._split(*(self._reasoning.feed(text) if self._reasoning else ("", text)), last=False)

    def finish(self) -> OutputDelta:
        return self._split(*(self._reasoning.finish() if self._reasoning else ("", "")), last=True)

    def _split(self, reasoning: str, answer: str, last: bool) -> OutputDelta:
        out = OutputDelta(reasoning=reasoning)
        if self._tools is None:
            out.content = answer
            return out
        pieces = self._tools.feed(answer) if answer else []
        if last:
            pieces += self._tools.finish()
        for p in pieces:
            if isinstance(p, str):
                out.content += p
            else:
                out.tool_calls.append(p)
        self.calls = self._tools.calls
        return out


def whole(output: ChatOutput, text: str) -> Message:
    """The non-streamed message of a choice's text."""
    parts = [output.feed(text), output.finish()]
    calls: dict[int, list[str]] = {}
    for p in parts:
        for d in p.tool_calls:
            if d.index not in calls:
                calls[d.index] = [d.id or "", d.name or "", ""]
            calls[d.index][2] += d.arguments
    content = "".join(p.content for p in parts)
    reasoning = "".join(p.reasoning for p in parts)
    return Message(content=None if calls and not content else content, reasoning=reasoning or None,
                   tool_calls=[(c[0], c[1], c[2]) for _, c in sorted(calls.items())])
