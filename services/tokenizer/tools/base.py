"""The common incremental interface of tool-call parsers, and the scanners they share.

A parser is fed a choice's generated text in pieces of any size (``feed``) and told when it ends
(``finish``). It returns ``Piece``s: content text (``str``, never markup) and ``ToolCallDelta``s
(OpenAI's stream shape: the first delta of a call carries its id and name, the later ones pieces
of its arguments). Parsers work character by character on what they are sure of, holding back only
what could still be the start of markup, so the pieces of any split of a text concatenate to the
same content and the same calls: a non-streamed response is the same parser fed the whole text.

Content next to a call loses the whitespace between it and the call (``Hi.\\n<tool_call>`` gives
``Hi.``), and whitespace (or the format's separators) between calls is dropped.
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True)
class ToolCallDelta:
    index: int  # the call's position among the choice's calls
    id: str | None = None  # the first delta of a call: its id and name
    name: str | None = None
    arguments: str = ""  # a piece of the JSON arguments


Piece = str | ToolCallDelta


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def longest_prefix_suffix(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest end of ``text`` that is a proper start of one of ``markers``."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:k]):
                best = k
                break
    return best


class JsonValue:
    """One JSON object or array, scanned character by character: ``feed`` says how many characters
    of a text belong to it (leading whitespace is skipped, not counted in ``text``) and whether it
    is complete."""

    def __init__(self) -> None:
        self.text = ""
        self.depth = 0
        self.in_str = self.esc = False
        self.done = False

    def feed(self, s: str) -> int:
        """Characters of ``s`` consumed (whitespace before the value included); ``done`` once closed."""
        i = 0
        while i < len(s) and not self.done:
            ch = s[i]
            i += 1
            if not self.text and ch.isspace():
                continue
            self.text += ch
            if not self.in_str and self.depth == 0 and ch not in '{["}]':  # not an object or array: a malformed call
                self.done = True
                continue
            self.step(ch)
            self.done = not self.in_str and ch in "}]" and self.depth <= 0
        return i

    def step(self, ch: str) -> None:
        """Advance the string / escape / nesting state by one character already appended to ``text``."""
        if self.in_str:
            if self.esc:
                self.esc = False
            elif ch == "\\":
                self.esc = True
            elif ch == '"':
                self.in_str = False
        elif ch == '"':
            self.in_str = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1


ARG_KEYS = ("arguments", "parameters")


class JsonCall(JsonValue):
    """One call spelled as a JSON object ``{"name": ..., "arguments": {...}}`` (or ``parameters``),
    scanned character by character. Once the name is known and the arguments object begins, its
    characters stream out as they come; otherwise (arguments before the name, arguments given as a
    JSON string) the call comes out whole when the object closes."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.text = ""
        self.depth = 0
        self.in_str = self.esc = False
        self.done = False
        self.expect = "key"  # at depth 1: key | colon | value | string | scalar | nested | comma
        self.key: str | None = None
        self.mark = -1  # where the depth-1 string or value being read starts
        self.name: str | None = None
        self.started = False
        self.streaming = False  # inside a streamed arguments object
        self.args_sent = False

    def feed(self, s: str) -> tuple[list[Piece], int]:
        """(pieces, characters of ``s`` consumed); ``done`` once the object closed."""
        out: list[Piece] = []
        args: list[str] = []
        i = 0
        while i < len(s) and not self.done:
            ch = s[i]
            i += 1
            if not self.text and ch.isspace():
                continue
            pos, d0, was_str = len(self.text), self.depth, self.in_str
            self.text += ch
            if pos == 0 and ch != "{":  # not an object: a malformed call, ends here
                self.done = True
                break
            self.step(ch)
            if self.streaming:
                args.append(ch)
                if self.depth == 1:  # the arguments object closed
                    self.streaming, self.args_sent, self.expect = False, True, "comma"
                continue
            if self.depth <= 0:
                self.done = True
            elif d0 >= 2:
                if self.depth == 1:  # a nested value closed
                    self.expect = "comma"
            elif d0 == 1:
                self._depth1(ch, pos, was_str, out, args)
        if args:
            out.append(ToolCallDelta(self.index, arguments="".join(args)))
        if self.done:
            out.extend(self._close())
        return _merge(out), i

    def _depth1(self, ch: str, pos: int, was_str: bool, out: list[Piece], args: list[str]) -> None:
        closed_str = was_str and not self.in_str
        if self.expect == "key":
            if ch == '"' and not was_str:
                self.mark = pos
            elif closed_str:
                self.key = json.loads(self.text[self.mark:pos + 1])
                self.expect = "colon"
        elif self.expect == "colon":
            if ch == ":":
                self.expect = "value"
        elif self.expect == "value":
            if ch.isspace():
                return
            self.mark = pos
            if ch == "{" and self.key in ARG_KEYS and self.name is not None:
                out.extend(self._start())
                self.streaming = True
                args.append(ch)
            elif ch in "{[":
                self.expect = "nested"
            elif ch == '"':
                self.expect = "string"
            else:
                self.expect = "scalar"
        elif self.expect == "string":
            if closed_str:
                value = json.loads(self.text[self.mark:pos + 1])
                if self.key == "name" and isinstance(value, str) and self.name is None:
                    self.name = value
                    out.extend(self._start())
                self.expect = "comma"
        elif self.expect in ("scalar", "comma") and ch == ",":
            self.expect = "key"

    def _start(self) -> list[Piece]:
        if self.started or self.name is None:
            return []
        self.started = True
        return [ToolCallDelta(self.index, id=new_call_id(), name=self.name)]

    def _close(self) -> list[Piece]:
        """The object closed: what is still owed (the whole call, or arguments not streamed)."""
        out: list[Piece] = []
        try:
            obj = json.loads(self.text)
        except json.JSONDecodeError:
            obj = None
        if not isinstance(obj, dict):
            obj = {}
        if self.name is None:
            name = obj.get("name")
            self.name = name if isinstance(name, str) else ""
        out.extend(self._start())
        if not self.args_sent:
            out.append(ToolCallDelta(self.index, arguments=arguments_text(obj)))
            self.args_sent = True
        return out

    def finish(self) -> list[Piece]:
        """The text ended inside the object: a started call keeps what it has."""
        self.done = True
        return []


def arguments_text(obj: dict) -> str:
    """The arguments of a parsed call object as OpenAI's JSON string."""
    args = next((obj[k] for k in ARG_KEYS if k in obj), {})
    if isinstance(args, str):  # some models give the arguments JSON-encoded
        try:
            json.loads(args)
            return args
        except json.JSONDecodeError:
            return json.dumps(args)
    return json.dumps(args, ensure_ascii=False)


def _merge(pieces: list[Piece]) -> list[Piece]:
    """Adjacent content strings, and adjacent argument pieces of one call, joined."""
    out: list[Piece] = []
    for p in pieces:
        last = out[-1] if out else None
        if isinstance(p, str) and isinstance(last, str):
            out[-1] = last + p
        elif (isinstance(p, ToolCallDelta) and isinstance(last, ToolCallDelta) and p.id is None
              and p.index == last.index):
            out[-1] = ToolCallDelta(last.index, last.id, last.name, last.arguments + p.arguments)
        elif not (isinstance(p, str) and not p):
            out.append(p)
    return out


class ToolParser(ABC):
    """A format's incremental parser (one per choice). Subclasses handle the inside of markup;
    this class the text around it: markers held back until they are sure, whitespace next to
    calls dropped."""

    name: ClassVar[str]
    markers: ClassVar[tuple[str, ...]]  # where a call (or a block of calls) begins
    between: ClassVar[str] = " \t\r\n"  # dropped after a call, before the next text
    keep_marker: ClassVar[bool] = False  # the marker is part of the call's own text (a JSON object's start)

    def __init__(self) -> None:
        self.calls = 0  # calls begun so far
        self._tail = ""  # text that may be the start of a marker
        self._ws = ""  # whitespace held back at the end of the content
        self._after_call = False
        self._in_call = False

    # -- the subclass's part --
    @abstractmethod
    def _open(self, marker: str) -> None:
        """A marker was found: a call (or block) begins."""

    @abstractmethod
    def _inside(self, s: str) -> tuple[list[Piece], int, bool]:
        """Feed text inside markup: (pieces, characters consumed, whether the markup ended). Consuming
        nothing (without ending) asks for more text: the same text comes back with the next piece."""

    def _inside_end(self) -> list[Piece]:
        """The text ended inside markup."""
        return []

    def _allowed_here(self, out_so_far: str, marker: str) -> bool:
        """Whether a marker found after ``out_so_far`` content starts a call (default: always)."""
        return True

    # -- the common part --
    def feed(self, text: str) -> list[Piece]:
        out: list[Piece] = []
        s = self._tail + text
        self._tail = ""
        while s:
            if self._in_call:
                pieces, used, ended = self._inside(s)
                out.extend(pieces)
                if used == 0 and not ended:  # it needs more text to decide: keep this for the next feed
                    self._tail = s
                    break
                s = s[used:]
                if ended:
                    self._in_call, self._after_call = False, True
                continue
            found = min(((s.find(m), m) for m in self.markers if m in s), default=None)
            if found is None:
                k = longest_prefix_suffix(s, self.markers)
                self._text(s[:len(s) - k], out)
                self._tail = s[len(s) - k:]
                break
            at, marker = found
            self._text(s[:at], out)
            self._ws = ""
            self._in_call, self._after_call = True, False
            self._open(marker)
            s = s[at:] if self.keep_marker else s[at + len(marker):]
        return _merge(out)

    def finish(self) -> list[Piece]:
        out: list[Piece] = []
        if self._in_call:
            out.extend(self._inside_end())
        else:
            self._text(self._tail, out)
            if self._ws and not self._after_call:
                out.append(self._ws)
        self._tail = self._ws = ""
        return _merge(out)

    def _text(self, s: str, out: list[Piece]) -> None:
        if self._after_call:
            s = s.lstrip(self.between)
            if not s:
                return
            self._after_call = False
        s = self._ws + s
        body = s.rstrip()
        self._ws = s[len(body):]
        if body:
            out.append(body)
