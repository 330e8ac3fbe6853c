"""The output items of one ``/v1/responses`` answer as its text comes, and the stream events that
build them: a ``message`` item (its ``output_text``) and, with a tool-call parser
(``services/tokenizer/tools``), one ``function_call`` item per call, whose arguments stream as
``response.function_call_arguments.delta`` / ``.done``. The streamed events and the non-streamed
``output`` come from the same pieces, so they agree."""

from __future__ import annotations

from typing import Any

from services.tokenizer.http import responses_api as rapi
from services.tokenizer.tools.base import Piece, ToolCallDelta, ToolParser

Event = tuple[str, dict[str, Any]]  # (type, fields)


class _Call:
    def __init__(self, item_id: str, call_id: str, name: str, output_index: int) -> None:
        self.item_id, self.call_id, self.name, self.output_index = item_id, call_id, name, output_index
        self.arguments: list[str] = []

    def item(self, status: str) -> rapi.FunctionCall:
        return rapi.FunctionCall(id=self.item_id, call_id=self.call_id, name=self.name,
                                 arguments="".join(self.arguments), status=status)


class Output:
    """``feed`` a choice's text in pieces of any size, then ``finish``: each returns the events of
    what it added; ``items`` is the ``output`` list so far."""

    def __init__(self, rid: str, parser: ToolParser | None = None) -> None:
        self.rid, self.parser = rid, parser
        self.msg_id = f"msg_{rid}"
        self.text: list[str] = []
        self.msg_index: int | None = None  # the message item's output_index, once it began
        self.calls: list[_Call] = []
        self._next = 0

    def _open_message(self) -> list[Event]:
        self.msg_index, self._next = self._next, self._next + 1
        part = dict(item_id=self.msg_id, output_index=self.msg_index, content_index=0)
        return [("response.output_item.added", dict(output_index=self.msg_index,
                                                     item=self.message("in_progress").model_dump())),
                ("response.content_part.added", dict(part, part=rapi.OutputText(text="").model_dump()))]

    def _pieces(self, pieces: list[Piece]) -> list[Event]:
        events: list[Event] = []
        for p in pieces:
            if isinstance(p, str):
                if not p:
                    continue
                if self.msg_index is None:
                    events += self._open_message()
                self.text.append(p)
                events.append(("response.output_text.delta", dict(item_id=self.msg_id, output_index=self.msg_index,
                                                                  content_index=0, delta=p, logprobs=[])))
                continue
            events += self._call(p)
        return events

    def _call(self, d: ToolCallDelta) -> list[Event]:
        events: list[Event] = []
        if d.index >= len(self.calls):  # a call begins: its id and name
            call = _Call(f"fc_{self.rid}_{d.index}", d.id or f"call_{self.rid}_{d.index}", d.name or "", self._next)
            self._next += 1
            self.calls.append(call)
            events.append(("response.output_item.added", dict(output_index=call.output_index,
                                                              item=call.item("in_progress").model_dump())))
        call = self.calls[d.index]
        if d.arguments:
            call.arguments.append(d.arguments)
            events.append(("response.function_call_arguments.delta", dict(item_id=call.item_id,
                                                                          output_index=call.output_index,
                                                                          delta=d.arguments)))
        return events

    def feed(self, text: str) -> list[Event]:
        return self._pieces(self.parser.feed(text) if self.parser is not None else [text])

    def finish(self, status: str) -> list[Event]:
        """The last pieces, then each item's closing events (``status``: the items' final status)."""
        events = self._pieces(self.parser.finish()) if self.parser is not None else []
        if self.msg_index is None and not self.calls:  # (an empty answer is an empty message)
            events += self._open_message()
        if self.msg_index is not None:
            text, part = "".join(self.text), dict(item_id=self.msg_id, output_index=self.msg_index, content_index=0)
            events += [("response.output_text.done", dict(part, text=text, logprobs=[])),
                       ("response.content_part.done", dict(part, part=rapi.OutputText(text=text).model_dump())),
                       ("response.output_item.done", dict(output_index=self.msg_index,
                                                          item=self.message(status).model_dump()))]
        for call in self.calls:
            events += [("response.function_call_arguments.done", dict(item_id=call.item_id,
                                                                      output_index=call.output_index,
                                                                      arguments="".join(call.arguments))),
                       ("response.output_item.done", dict(output_index=call.output_index,
                                                          item=call.item("completed").model_dump()))]
        return events

    def message(self, status: str) -> rapi.OutputMessage:
        text = "".join(self.text)
        content = [rapi.OutputText(text=text)] if status != "in_progress" else []
        return rapi.OutputMessage(id=self.msg_id, status=status, content=content)

    def items(self, status: str) -> list[rapi.OutputMessage | rapi.FunctionCall]:
        out: list[tuple[int, rapi.OutputMessage | rapi.FunctionCall]] = [
            (c.output_index, c.item("completed")) for c in self.calls]
        if self.msg_index is not None:
            out.append((self.msg_index, self.message(status)))
        return [item for _, item in sorted(out, key=lambda x: x[0])]
