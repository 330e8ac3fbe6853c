"""DeepSeek-V3 (and V3.1) tool calls::

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    ```json
    {...}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

V3.1 drops the type and the fence: ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>``."""

from __future__ import annotations

from services.tokenizer.tools.base import JsonValue, Piece, ToolCallDelta, ToolParser, new_call_id

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
FENCE = "```json"


class DeepSeekV3Parser(ToolParser):
    name = "deepseek_v3"
    markers = (CALLS_BEGIN, CALL_BEGIN)

    def __init__(self) -> None:
        super().__init__()
        self._buf = ""  # text of the current call not yet placed
        self._state = "between"  # between | header | name | args | after
        self._header = ""
        self._args: JsonValue | None = None

    def _open(self, marker: str) -> None:
        self._buf, self._state = "", ("header" if marker == CALL_BEGIN else "between")

    def _inside(self, s: str) -> tuple[list[Piece], int, bool]:
        out: list[Piece] = []
        s = self._buf + s
        base = len(self._buf)  # characters of s that were fed before
        self._buf = ""
        i = 0
        while i < len(s):
            rest = s[i:]
            if self._state == "between":  # between calls: the next call, or the block's end
                for m, nxt in ((CALL_BEGIN, "header"), (CALLS_END, "end")):
                    if rest.startswith(m):
                        i += len(m)
                        if nxt == "end":
                            return out, i - base, True
                        self._state, self._header = nxt, ""
                        break
                else:
                    if any(m.startswith(rest) for m in (CALL_BEGIN, CALLS_END)):
                        self._buf = rest
                        return out, len(s) - base, False
                    i += 1  # (whitespace between calls, or stray text: dropped)
                continue
            if self._state == "header":  # "function" (V3) or the name (V3.1), up to SEP
                at = rest.find(SEP)
                if at < 0:
                    keep = next((k for k in range(len(SEP) - 1, 0, -1) if rest.endswith(SEP[:k])), 0)
                    self._header += rest[:len(rest) - keep]
                    self._buf = rest[len(rest) - keep:]
                    return out, len(s) - base, False
                self._header += rest[:at]
                i += at + len(SEP)
                if self._header.strip() == "function":
                    self._state, self._header = "name", ""
                else:
                    out.extend(self._begin(self._header.strip()))
                continue
            if self._state == "name":  # V3: the name ends the line, then the fence
                at = rest.find("{")
                if at < 0:
                    self._buf = rest
                    return out, len(s) - base, False
                head = rest[:at]
                name = head.split("\n", 1)[0].strip()
                i += at
                out.extend(self._begin(name))
                continue
            if self._state == "args":
                assert self._args is not None
                before = len(self._args.text)
                i += self._args.feed(rest)
                if len(self._args.text) > before:
                    out.append(ToolCallDelta(self.calls - 1, arguments=self._args.text[before:]))
                if self._args.done:
                    self._state = "after"
                continue
            # after the arguments: the closing fence, up to CALL_END
            at = rest.find(CALL_END)
            if at < 0:
                self._buf = rest[-(len(CALL_END) - 1):]
                return out, len(s) - base, False
            i += at + len(CALL_END)
            self._state = "between"
        return out, len(s) - base, False

    def _begin(self, name: str) -> list[Piece]:
        self._args, self._state = JsonValue(), "args"
        self.calls += 1
        return [ToolCallDelta(self.calls - 1, id=new_call_id(), name=name)]

    @staticmethod
    def call_begin(name: str) -> str:
        return f"{CALL_BEGIN}function{SEP}{name}\n{FENCE}\n"

    call_end = f"\n```{CALL_END}"
    separator = "\n"
    trigger = CALLS_BEGIN
    block = (CALLS_BEGIN, CALLS_END)
