"""Llama 3.x JSON tool calls: ``{"name": ..., "parameters": {...}}`` (after ``<|python_tag|>`` or
alone), several separated by ``;``."""

from __future__ import annotations

from services.tokenizer.tools.base import JsonCall, Piece, ToolParser

PYTHON_TAG = "<|python_tag|>"
OBJECT_STARTS = ('{"name"', '{ "name"')


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    markers = (PYTHON_TAG, *OBJECT_STARTS)
    between = " \t\r\n;"
    keep_marker = True

    def __init__(self) -> None:
        super().__init__()
        self._call: JsonCall | None = None

    def _open(self, marker: str) -> None:
        self._call = None

    def _inside(self, s: str) -> tuple[list[Piece], int, bool]:
        if self._call is None:
            if s.startswith(PYTHON_TAG):  # (the tag itself is dropped; its call follows)
                return [], len(PYTHON_TAG), True
            self._call = JsonCall(self.calls)
            self.calls += 1
        pieces, used = self._call.feed(s)
        return pieces, used, self._call.done

    def _inside_end(self) -> list[Piece]:
        return self._call.finish() if self._call is not None else []

    @staticmethod
    def call_begin(name: str) -> str:
        return f'{{"name": "{name}", "parameters": '

    call_end = "}"
    separator = "; "
    trigger = '{"name"'
