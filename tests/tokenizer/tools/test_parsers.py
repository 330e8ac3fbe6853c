"""Every tool-call parser on real samples of its format, fed whole, in chunks of every size and
token by token (a real tokenizer's pieces): the same content and the same calls each time."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from services.tokenizer.tools import PARSERS, ToolCallDelta, detect, resolve

QWEN3 = Path("/work/shared/assets/tokenizers/qwen3")


def run(parser_name: str, pieces: list[str]) -> tuple[str, list[dict]]:
    """(content, calls) from feeding ``pieces``; checks the delta shape on the way."""
    p = PARSERS[parser_name]()
    content, calls = [], {}
    deltas = [d for piece in pieces for d in p.feed(piece)] + p.finish()
    for d in deltas:
        if isinstance(d, str):
            assert d, "empty content piece"
            content.append(d)
            continue
        assert isinstance(d, ToolCallDelta)
        if d.index not in calls:
            assert d.id is not None and d.name is not None, f"a call's first delta has no id/name: {d}"
            assert d.index == len(calls), "calls are numbered in order"
            calls[d.index] = {"name": d.name, "arguments": d.arguments}
        else:
            assert d.id is None and d.name is None, "id and name come once"
            calls[d.index]["arguments"] += d.arguments
    return "".join(content), [calls[i] for i in sorted(calls)]


def chunked(text: str, size: int) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(QWEN3)


def by_token(tokenizer, text: str) -> list[str]:
    """The text as a model would stream it: the decoded text of each token (incremental decode)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    out, prev = [], ""
    for i in range(1, len(ids) + 1):
        cur = tokenizer.decode(ids[:i])
        if not cur.endswith("\ufffd"):
            out.append(cur[len(prev):])
            prev = cur
    assert "".join(out) == text
    return out


NESTED = {"query": {"filters": [{"field": "a\"b", "op": "=", "value": "x}y{"}], "limit": 3},
          "note": "say \\\"hi\\\" \u00e9 \U0001f600", "ok": True, "n": None}
CASES = [
    # (parser, text, content, [(name, arguments)])
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     "Let me check.", [("get_weather", {"city": "Paris"})]),
    ("hermes", '<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n<tool_call>\n'
               '{"name": "b", "arguments": ' + json.dumps(NESTED) + '}\n</tool_call>',
     "", [("a", {"x": 1}), ("b", NESTED)]),
    ("hermes", '<tool_call>\n{"arguments": {"x": [1, 2]}, "name": "late_name"}\n</tool_call>', "",
     [("late_name", {"x": [1, 2]})]),
    ("hermes", 'No tools needed: 1 < 2 and <tool is not a tag.', "No tools needed: 1 < 2 and <tool is not a tag.", []),
    ("hermes", '<tool_call>{"name": "s", "arguments": "{\\"k\\": \\"v\\"}"}</tool_call> done', "done",
     [("s", {"k": "v"})]),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}', "",
     [("get_weather", {"city": "Paris", "unit": "celsius"})]),
    ("llama3_json", '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": '
                    + json.dumps(NESTED) + '}', "", [("a", {}), ("b", NESTED)]),
    ("llama3_json", 'The answer is {42}.', "The answer is {42}.", []),
    ("mistral", 'Sure.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                '{"name": "b", "arguments": ' + json.dumps(NESTED) + '}]',
     "Sure.", [("get_weather", {"city": "Paris"}), ("b", NESTED)]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]b[ARGS]' + json.dumps(NESTED), "",
     [("get_weather", {"city": "Paris"}), ("b", NESTED)]),
    ("pythonic", '[get_weather(city="Paris", days=3), find(q={"a": [1, "x)"]}, s=\'it\\\'s\'), now()]', "",
     [("get_weather", {"city": "Paris", "days": 3}), ("find", {"q": {"a": [1, "x)"]}, "s": "it's"}), ("now", {})]),
    ("pythonic", '<|python_start|>[f(x=None, y=True)]<|python_end|>', "", [("f", {"x": None, "y": True})]),
    ("pythonic", '[1, 2] is a list, not a call.', "[1, 2] is a list, not a call.", []),
    ("deepseek_v3", 'Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n'
                    '```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>b\n'
                    '```json\n' + json.dumps(NESTED) + '\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
     "Checking.", [("get_weather", {"city": "Paris"}), ("b", NESTED)]),
    ("deepseek_v31", '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}'
                     '<｜tool▁call▁end｜><｜tool▁calls▁end｜>', "", [("get_weather", {"city": "Paris"})]),
]


@pytest.mark.parametrize("parser,text,content,expected", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_every_split_gives_the_same_calls(parser, text, content, expected, tokenizer):
    whole_content, whole_calls = run(parser, [text])
    assert whole_content == content
    assert [(c["name"], json.loads(c["arguments"])) for c in whole_calls] == expected
    for size in range(1, len(text) + 1):
        assert run(parser, chunked(text, size)) == (whole_content, whole_calls), f"chunks of {size}"
    assert run(parser, by_token(tokenizer, text)) == (whole_content, whole_calls), "token by token"


def test_streamed_arguments_arrive_in_pieces():
    """Arguments stream as they come (not all at the end), and no markup leaks into content."""
    text = '<tool_call>\n{"name": "f", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
    p = PARSERS["hermes"]()
    seen = [d for ch in text for d in p.feed(ch)] + p.finish()
    pieces = [d.arguments for d in seen if isinstance(d, ToolCallDelta) and d.id is None]
    assert len(pieces) > 10 and "".join(pieces) == '{"city": "Paris", "days": 3}'
    assert not [d for d in seen if isinstance(d, str)]


def test_cut_off_call_keeps_what_it_has():
    p = PARSERS["hermes"]()
    out = p.feed('<tool_call>\n{"name": "f", "arguments": {"city": "Par') + p.finish()
    assert [d.name for d in out if isinstance(d, ToolCallDelta) and d.name] == ["f"]
    assert "".join(d.arguments for d in out if isinstance(d, ToolCallDelta)) == '{"city": "Par'


def test_detection_from_templates():
    qwen3 = json.loads((QWEN3 / "tokenizer_config.json").read_text())["chat_template"]
    llama3 = json.loads(Path("/work/shared/assets/tokenizers/llama3/tokenizer_config.json").read_text())
    assert detect(qwen3) == "hermes"
    assert detect(llama3.get("chat_template")) is None  # (Llama 3.0's template renders no tools)
    llama31 = '{%- if tools %}{{- "<|python_tag|>" }}{{- \'{"name": "\' }}...{{- \'"parameters": \' }}{% endif %}'
    assert detect(llama31) == "llama3_json"
    assert detect("{{ messages }}") is None
    assert detect("{% if tools %}<tool_call>[TOOL_CALLS]{% endif %}") is None  # ambiguous
    assert resolve("none", qwen3) is None and resolve("pythonic", qwen3) == "pythonic"
    with pytest.raises(ValueError, match="unknown tool call parser"):
        resolve("nope", qwen3)
