"""Hermes / Qwen2.5 / Qwen3: each call is ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``."""

from __future__ import annotations

from services.tokenizer.tools.base import JsonCall, Piece, ToolParser

BEGIN, END = "<tool_call>", "</tool_call>"


class HermesParser(ToolParser):
    name = "hermes"
    markers = (BEGIN,)

    def __init__(self) -> None:
        super().__init__()
        self._call: JsonCall | None = None
        self._closing = ""  # text after the object, up to END

    def _open(self, marker: str) -> None:
        self._call, self._closing = JsonCall(self.calls), ""
        self.calls += 1

    def _inside(self, s: str) -> tuple[list[Piece], int, bool]:
        assert self._call is not None
        pieces: list[Piece] = []
        used = 0
        if not self._call.done:
            pieces, used = self._call.feed(s)
            if not self._call.done:
                return pieces, used, False
        rest = self._closing + s[used:]
        at = rest.find(END)
        if at >= 0:  # (anything between the object and END is dropped)
            return pieces, len(s) - (len(rest) - at - len(END)), True
        self._closing = rest[-(len(END) - 1):]  # (enough to find END across pieces)
        return pieces, len(s), False

    def _inside_end(self) -> list[Piece]:
        return self._call.finish() if self._call is not None else []

    # grammar (tool_choice required / named): see grammar.py
    @staticmethod
    def call_begin(name: str) -> str:
        return f'{BEGIN}\n{{"name": "{name}", "arguments": '

    call_end = "}\n" + END
    separator = "\n"
    trigger = BEGIN
