"""Mistral: ``[TOOL_CALLS]`` then a JSON array of calls ``[{"name": ..., "arguments": {...}}, ...]``,
or (v11 tokenizers and later) ``[TOOL_CALLS]name[ARGS]{...}``, repeated for several calls."""

from __future__ import annotations

from services.tokenizer.tools.base import JsonCall, JsonValue, Piece, ToolCallDelta, ToolParser, new_call_id

BEGIN, ARGS = "[TOOL_CALLS]", "[ARGS]"


class MistralParser(ToolParser):
    name = "mistral"
    markers = (BEGIN,)

    def __init__(self) -> None:
        super().__init__()
        self._mode = ""  # "" (not yet known) | array | named
        self._call: JsonCall | None = None
        self._name = ""  # named form: the name read so far
        self._args: JsonValue | None = None

    def _open(self, marker: str) -> None:
        self._mode, self._call, self._name, self._args = "", None, "", None

    def _inside(self, s: str) -> tuple[list[Piece], int, bool]:
        if not self._mode:
            stripped = s.lstrip()
            if not stripped:
                return [], len(s), False
            self._mode = "array" if stripped[0] == "[" else "named"
            skip = len(s) - len(stripped) + (1 if self._mode == "array" else 0)
            pieces, used, ended = self._inside(s[skip:]) if skip < len(s) else ([], 0, False)
            return pieces, skip + used, ended
        return self._array(s) if self._mode == "array" else self._named(s)

    def _array(self, s: str) -> tuple[list[Piece], int, bool]:
        if self._call is not None and not self._call.done:
            pieces, used = self._call.feed(s)
            return pieces, used, False
        i = 0
        while i < len(s) and (s[i].isspace() or s[i] == ","):
            i += 1
        if i == len(s):
            return [], i, False
        if s[i] != "{":  # "]" (or anything else) ends the array
            return [], i + 1, True
        self._call = JsonCall(self.calls)
        self.calls += 1
        return [], i, False

    def _named(self, s: str) -> tuple[list[Piece], int, bool]:
        if self._args is None:
            at = s.find(ARGS)
            brace = s.find("{")
            if at < 0 and brace < 0:  # the name goes on (keep what could be the start of [ARGS])
                keep = next((k for k in range(len(ARGS) - 1, 0, -1) if s.endswith(ARGS[:k])), 0)
                self._name += s[:len(s) - keep]
                return [], len(s) - keep, False
            cut = at if at >= 0 and (brace < 0 or at < brace) else brace
            self._name += s[:cut]
            self._args = JsonValue()
            index, self.calls = self.calls, self.calls + 1
            start = ToolCallDelta(index, id=new_call_id(), name=self._name.strip())
            used = cut + (len(ARGS) if cut == at else 0)
            pieces, more, ended = self._named(s[used:])
            return [start, *pieces], used + more, ended
        before = len(self._args.text)
        used = self._args.feed(s)
        piece = self._args.text[before:]
        out: list[Piece] = [ToolCallDelta(self.calls - 1, arguments=piece)] if piece else []
        return out, used, self._args.done

    @staticmethod
    def call_begin(name: str) -> str:
        return f'{{"name": "{name}", "arguments": '

    call_end = "}"
    separator = ", "
    trigger = BEGIN
