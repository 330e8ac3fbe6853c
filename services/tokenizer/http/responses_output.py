"""The output items of one ``/v1/responses`` answer as its text comes, and the stream events that
build them: a ``message`` item (its ``output_text``); with a reasoning parser a ``reasoning`` item
first (``response.reasoning_text.delta`` / ``.done``); with a tool-call parser
(``services/tokenizer/tools``) one ``function_call`` item per call, whose arguments stream as
``response.function_call_arguments.delta`` / ``.done``. The text is split by the chat route's
``ChatOutput``; the streamed events and the non-streamed ``output`` come from the same pieces, so
they agree."""

from __future__ import annotations

from typing import Any

from services.tokenizer.chat_output import ChatOutput, OutputDelta
from services.tokenizer.http import responses_api as rapi
from services.tokenizer.tools.base import ToolCallDelta

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

    def __init__(self, rid: str, split: ChatOutput | None = None) -> None:
        self.rid, self.split = rid, split
        self.msg_id, self.rs_id = f"msg_{rid}", f"rs_{rid}"
        self.text: list[str] = []
        self.thinking: list[str] = []
        self.msg_index: int | None = None  # the message item's output_index, once it began
        self.rs_index: int | None = None  # the reasoning item's
        self.calls: list[_Call] = []
        self._next = 0

    def _open_message(self) -> list[Event]:
        self.msg_index, self._next = self._next, self._next + 1
        part = dict(item_id=self.msg_id, output_index=self.msg_index, content_index=0)
        return [("response.output_item.added", dict(output_index=self.msg_index,
                                                     item=self.message("in_progress").model_dump())),
                ("response.content_part.added", dict(part, part=rapi.OutputText(text="").model_dump()))]

    def _pieces(self, d: OutputDelta) -> list[Event]:
        events: list[Event] = []
        if d.reasoning:
            if self.rs_index is None:
                self.rs_index, self._next = self._next, self._next + 1
                events.append(("response.output_item.added", dict(output_index=self.rs_index,
                                                                  item=self.reasoning("in_progress").model_dump())))
            self.thinking.append(d.reasoning)
            events.append(("response.reasoning_text.delta", dict(item_id=self.rs_id, output_index=self.rs_index,
                                                                 content_index=0, delta=d.reasoning)))
        if d.content:
            if self.msg_index is None:
                events += self._open_message()
            self.text.append(d.content)
            events.append(("response.output_text.delta", dict(item_id=self.msg_id, output_index=self.msg_index,
                                                              content_index=0, delta=d.content, logprobs=[])))
        for call in d.tool_calls:
            events += self._call(call)
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
        return self._pieces(self.split.feed(text) if self.split is not None else OutputDelta(content=text))

    def finish(self, status: str) -> list[Event]:
        """The last pieces, then each item's closing events (``status``: the items' final status)."""
        events = self._pieces(self.split.finish()) if self.split is not None else []
        if self.msg_index is None and not self.calls:  # (an empty answer is an empty message)
            events += self._open_message()
        if self.rs_index is not None:
            events += [("response.reasoning_text.done", dict(item_id=self.rs_id, output_index=self.rs_index,
                                                             content_index=0, text="".join(self.thinking))),
                       ("response.output_item.done", dict(output_index=self.rs_index,
                                                          item=self.reasoning(status).model_dump()))]
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

    def reasoning(self, status: str) -> rapi.ReasoningItem:
        content = [rapi.ReasoningText(text="".join(self.thinking))] if status != "in_progress" else []
        return rapi.ReasoningItem(id=self.rs_id, status=status, content=content)

    def message(self, status: str) -> rapi.OutputMessage:
        text = "".join(self.text)
        content = [rapi.OutputText(text=text)] if status != "in_progress" else []
        return rapi.OutputMessage(id=self.msg_id, status=status, content=content)

    def items(self, status: str) -> list[rapi.ReasoningItem | rapi.OutputMessage | rapi.FunctionCall]:
        out: list[tuple[int, rapi.ReasoningItem | rapi.OutputMessage | rapi.FunctionCall]] = [
            (c.output_index, c.item("completed")) for c in self.calls]
        if self.msg_index is not None:
            out.append((self.msg_index, self.message(status)))
        if self.rs_index is not None:
            out.append((self.rs_index, self.reasoning(status)))
        return [item for _, item in sorted(out, key=lambda x: x[0])]
