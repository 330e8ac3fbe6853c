"""``/v1/responses`` output items from a choice's text (``http/responses_output.py``): plain text,
with a tool-call parser (Hermes / Qwen format) function_call items, with a reasoning parser (Qwen3)
a reasoning item first; streamed in pieces of every size, the events add up to the same items the
non-streamed answer has."""

from __future__ import annotations

import json

import pytest

from services.tokenizer.http.responses_output import Output
from services.tokenizer.chat_output import ChatOutput

CALLS = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "when": {"day": '
         '"mon"}, "note": "say \\"hi\\""}}\n</tool_call>\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>')


def _replay(events) -> dict:
    """What a client builds from the events: text, and each call's name and arguments."""
    text, calls, done = [], {}, {}
    for kind, f in events:
        if kind == "response.output_text.delta":
            text.append(f["delta"])
        elif kind == "response.output_item.added" and f["item"]["type"] == "function_call":
            calls[f["item"]["id"]] = [f["item"]["name"], ""]
        elif kind == "response.function_call_arguments.delta":
            calls[f["item_id"]][1] += f["delta"]
        elif kind == "response.function_call_arguments.done":
            assert f["arguments"] == calls[f["item_id"]][1]
        elif kind == "response.output_item.done":
            done[f["output_index"]] = f["item"]
    return {"text": "".join(text), "calls": list(calls.values()), "done": [done[i] for i in sorted(done)]}


def _run(text: str, size: int, parser=None):
    out = Output("r1", parser)
    events = []
    for i in range(0, len(text), size):
        events += out.feed(text[i:i + size])
    events += out.finish("completed")
    return events, [item.model_dump() for item in out.items("completed")]


@pytest.mark.parametrize("size", [1, 2, 3, 5, 8, 13, 1000])
def test_function_calls_streamed_in_any_pieces_equal_the_items(size):
    events, items = _run(CALLS, size, ChatOutput("hermes", None))
    got = _replay(events)
    assert got["text"] == "Let me check."
    assert [c[0] for c in got["calls"]] == ["get_weather", "now"]
    assert json.loads(got["calls"][0][1]) == {"city": "Paris", "when": {"day": "mon"}, "note": 'say "hi"'}
    assert json.loads(got["calls"][1][1]) == {}
    assert got["done"] == items  # the stream's finished items are the response's output
    assert [i["type"] for i in items] == ["message", "function_call", "function_call"]
    assert items[0]["content"][0]["text"] == "Let me check."
    assert all(i["call_id"].startswith("call_") for i in items[1:])


@pytest.mark.parametrize("size", [1, 4, 1000])
def test_plain_text_is_one_message(size):
    text = "Hello <b>world</b>, no calls here."
    events, items = _run(text, size)
    kinds = [k for k, _ in events]
    assert kinds[:2] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-3:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert _replay(events)["text"] == text and items == [_replay(events)["done"][0]]
    assert items[0]["content"][0]["text"] == text and items[0]["status"] == "completed"


def test_an_empty_answer_is_an_empty_message():
    events, items = _run("", 1)
    assert [i["type"] for i in items] == ["message"] and items[0]["content"][0]["text"] == ""
    assert [k for k, _ in events][0] == "response.output_item.added"


THINK = '<think>\nThe user wants the weather.\n</think>\n\nIt is sunny.<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_reasoning_comes_first_as_its_own_item(size):
    events, items = _run(THINK, size, ChatOutput("hermes", "qwen3"))
    assert [i["type"] for i in items] == ["reasoning", "message", "function_call"]
    assert items[0]["content"][0]["text"].strip() == "The user wants the weather."
    thought = "".join(f["delta"] for k, f in events if k == "response.reasoning_text.delta")
    assert thought == items[0]["content"][0]["text"]
    assert next(f["text"] for k, f in events if k == "response.reasoning_text.done") == thought
    assert _replay(events)["text"] == "It is sunny." == items[1]["content"][0]["text"]
    assert [i["id"] for i in _replay(events)["done"]] == [i["id"] for i in items]
