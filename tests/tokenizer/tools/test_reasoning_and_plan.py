"""The reasoning split (every split of a text gives the same two parts), the tool plan's checks and
the grammar it builds, and the flags' choices matching the registries."""

from __future__ import annotations

import json

import pytest

from shared.config import REASONING_PARSERS as FLAG_REASONING, TOOL_CALL_PARSERS, TokenizerConfig, ConfigError
from shared.errors import InvalidArgument
from services.tokenizer.chat_output import ChatOutput, whole
from services.tokenizer.reasoning import REASONING_PARSERS, ReasoningParser
from services.tokenizer.tools import PARSERS
from services.tokenizer.tools.request import Function, plan, template_kwargs


def split(style: str, pieces: list[str], tail: str = "") -> tuple[str, str]:
    p = ReasoningParser(style, tail)
    parts = [p.feed(x) for x in pieces] + [p.finish()]
    return "".join(r for r, _ in parts), "".join(c for _, c in parts)


REASONING_CASES = [
    ("qwen3", "<think>\nLet me see: 2 < 3.\n</think>\n\nYes.", "", ("\nLet me see: 2 < 3.\n", "Yes.")),
    ("qwen3", "No thinking here </think> at all.", "", ("", "No thinking here </think> at all.")),
    ("qwen3", "Opened by the template.\n</think>\n\nAnswer", "<|im_start|>assistant\n<think>\n",
     ("Opened by the template.\n", "Answer")),
    ("qwen3", "<think>cut off mid-thou", "", ("cut off mid-thou", "")),
    ("deepseek_r1", "Thinking...</think>Answer <think>", "", ("Thinking...", "Answer <think>")),
    ("deepseek_r1", "<think>Thinking</think>\nAnswer", "", ("Thinking", "Answer")),
    ("deepseek_r1", "never closed <", "", ("never closed <", "")),
    ("qwen3", "<thin", "", ("", "<thin")),
]


@pytest.mark.parametrize("style,text,tail,expected", REASONING_CASES)
def test_reasoning_split_is_the_same_for_every_chunking(style, text, tail, expected):
    assert split(style, [text], tail) == expected
    for size in range(1, len(text) + 1):
        assert split(style, [text[i:i + size] for i in range(0, len(text), size)], tail) == expected, size


def test_calls_after_the_thinking_are_parsed_not_inside_it():
    text = ('<think>maybe <tool_call>{"name": "no", "arguments": {}}</tool_call></think>Sure.\n'
            '<tool_call>\n{"name": "yes", "arguments": {"a": 1}}\n</tool_call>')
    for size in (1, 3, len(text)):
        out = ChatOutput("hermes", "qwen3")
        deltas = [out.feed(text[i:i + size]) for i in range(0, len(text), size)] + [out.finish()]
        assert "".join(d.reasoning for d in deltas).startswith("maybe <tool_call>")
        assert "".join(d.content for d in deltas) == "Sure."
        assert [d.name for x in deltas for d in x.tool_calls if d.name] == ["yes"]
    m = whole(ChatOutput("hermes", "qwen3"), text)
    assert m.content == "Sure." and [(n, a) for _, n, a in m.tool_calls] == [("yes", '{"a": 1}')]


W = Function("get_weather", "Weather", {"type": "object", "properties": {"city": {"type": "string"}}})
T = Function("get_time", None, None, strict=True)


def test_plan_choices():
    assert plan(None, None, None, None, "hermes").tools == ()  # no tools: plain chat
    assert plan([], "auto", None, None, None).parser is None  # tools: [] is accepted
    auto = plan([W, T], None, None, None, "hermes")
    assert auto.choice == "auto" and auto.parser == "hermes" and len(auto.tools) == 2
    assert json.loads(auto.constraint.value)["format"]["type"] == "triggered_tags"  # (T is strict)
    assert plan([W], None, None, None, "hermes").constraint is None
    req = plan([W, T], "required", None, False, None)  # no server parser: the Hermes format is forced
    fmt = json.loads(req.constraint.value)["format"]
    assert req.parser == "hermes" and fmt["stop_after_first"] and fmt["at_least_one"]
    named = plan([W, T], "function", "get_time", None, "mistral")
    tags = json.loads(named.constraint.value)["format"]["elements"][1]["tags"]
    assert [t["begin"] for t in tags] == ['{"name": "get_time", "arguments": ']
    assert plan([W], "none", None, None, "hermes").tools == ()


@pytest.mark.parametrize("args,needle", [
    (([W], "auto", None, None, None), "--tool-call-parser"),
    (([], "required", None, None, "hermes"), "needs tools"),
    (([W], "function", "nope", None, "hermes"), "tool_choice.function.name"),
    (([W, W], None, None, None, "hermes"), "given twice"),
    (([Function("a b")], None, None, None, "hermes"), "tools[0].function.name"),
    (([W], "sometimes", None, None, "hermes"), "tool_choice must be"),
])
def test_plan_refusals_name_the_field(args, needle):
    with pytest.raises(InvalidArgument, match=needle.replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")):
        plan(*args)
    with pytest.raises(InvalidArgument, match="cannot be combined"):
        plan([W], "required", None, None, "hermes", other_constraint=True)


def test_template_kwargs():
    assert template_kwargs({"enable_thinking": False}) == (("enable_thinking", False),)
    for bad in ({"tools": []}, {"add_generation_prompt": True}, {"not a name": 1}):
        with pytest.raises(InvalidArgument, match="chat_template_kwargs"):
            template_kwargs(bad)


def test_flag_choices_are_the_registries():
    assert set(TOOL_CALL_PARSERS) == {"auto", "none", *PARSERS}
    assert set(FLAG_REASONING) == {"", *REASONING_PARSERS}
    with pytest.raises(ConfigError, match="tool_call_parser"):
        TokenizerConfig(tool_call_parser="nope")
    with pytest.raises(ConfigError, match="reasoning_parser"):
        TokenizerConfig(reasoning_parser="nope")
