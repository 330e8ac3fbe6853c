"""Pythonic tool calls (Llama 3.2 / 4, some fine-tunes): the output is a Python list of calls,
``[get_weather(city="Paris", days=3), get_time()]``, optionally inside ``<|python_start|>`` …
``<|python_end|>``. Only an output that begins that way is calls; the name of each call streams as
soon as its ``(`` arrives, its arguments (keyword literals, as JSON) when its ``)`` does."""

from __future__ import annotations

import ast
import json
import re

from services.tokenizer.tools.base import Piece, ToolCallDelta, ToolParser, new_call_id

PY_START, PY_END = "<|python_start|>", "<|python_end|>"
_YES = re.compile(r"\[\s*[A-Za-z_][\w.]*\s*\(")
_MAYBE = re.compile(r"\[\s*([A-Za-z_][\w.]*\s*)?")


def _verdict(head: str) -> str | None:
    """'calls', 'text' or None (cannot tell yet) for the output's beginning."""
    t = head.lstrip()
    if PY_START.startswith(t):
        return None
    if t.startswith(PY_START):
        t = t[len(PY_START):].lstrip()
    if not t:
        return None
    if _YES.match(t):
        return "calls"
    m = _MAYBE.match(t)
    return None if m is not None and m.end() == len(t) else "text"


def _arguments(name: str, inner: str) -> str:
    """A call's keyword arguments (Python literals) as a JSON object; {} when they do not parse."""
    try:
        call = ast.parse(f"f({inner})", mode="eval").body
        assert isinstance(call, ast.Call)
        return json.dumps({k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg is not None},
                          ensure_ascii=False)
    except (SyntaxError, ValueError, TypeError, AssertionError, RecursionError):
        return "{}"


class PythonicParser(ToolParser):
    name = "pythonic"
    markers = ()

    def __init__(self) -> None:
        super().__init__()
        self._mode: str | None = None  # None (undecided) | text | calls | after
        self._head = ""
        self._state = "open"  # open (before "[") | name | args | next
        self._name = ""
        self._inner = ""
        self._depth = 0
        self._quote = ""
        self._esc = False

    def _open(self, marker: str) -> None:  # (this format has no markers: feed is its own)
        raise AssertionError

    def _inside(self, s: str) -> tuple[list[Piece], int, bool]:
        raise AssertionError

    def feed(self, text: str) -> list[Piece]:
        if self._mode is None:
            self._head += text
            self._mode = _verdict(self._head)
            if self._mode is None:
                return []
            text, self._head = self._head, ""
            if self._mode == "calls":
                text = text.lstrip()
                text = text[len(PY_START):] if text.startswith(PY_START) else text
        if self._mode == "text":
            return [text] if text else []
        if self._mode == "after":
            return self._after(text)
        return self._calls(text)

    def finish(self) -> list[Piece]:
        if self._mode is None and self._head:
            return [self._head]
        return []

    def _after(self, text: str) -> list[Piece]:
        """Text after the list (``<|python_end|>`` and whitespace dropped)."""
        self._head += text
        t = self._head.lstrip()
        if PY_END.startswith(t) and t != PY_END:
            return []
        self._head, self._mode = "", "text"
        t = t[len(PY_END):].lstrip() if t.startswith(PY_END) else t
        return [t] if t else []

    def _calls(self, text: str) -> list[Piece]:
        out: list[Piece] = []
        for i, ch in enumerate(text):
            if self._state == "open":
                if ch == "[":
                    self._state = "next"
            elif self._state == "next":
                if ch == "]":
                    self._mode = "after"
                    return out + self._after(text[i + 1:])
                if not (ch.isspace() or ch == ","):
                    self._state, self._name = "name", ch
            elif self._state == "name":
                if ch == "(":
                    self._state, self._inner, self._depth = "args", "", 0
                    out.append(ToolCallDelta(self.calls, id=new_call_id(), name=self._name.strip()))
                    self.calls += 1
                else:
                    self._name += ch
            elif self._args_char(ch):
                out.append(ToolCallDelta(self.calls - 1, arguments=_arguments(self._name, self._inner)))
                self._state = "next"
        return out

    def _args_char(self, ch: str) -> bool:
        """One character inside a call's parentheses; True at the closing one."""
        if self._quote:
            if self._esc:
                self._esc = False
            elif ch == "\\":
                self._esc = True
            elif ch == self._quote:
                self._quote = ""
        elif ch in "'\"":
            self._quote = ch
        elif ch in "([{":
            self._depth += 1
        elif ch in ")]}":
            if ch == ")" and self._depth == 0:
                return True
            self._depth -= 1
        self._inner += ch
        return False
