"""Tool calling: one incremental parser per model format (``--tool-call-parser``), the grammar that
enforces a format under ``tool_choice`` required / named (and ``strict`` functions under auto), and
the request side (tools → the chat template, tool turns of the history). See docs/tools.md."""

from __future__ import annotations

from services.tokenizer.tools.base import Piece, ToolCallDelta, ToolParser
from services.tokenizer.tools.deepseek import DeepSeekV3Parser
from services.tokenizer.tools.hermes import HermesParser
from services.tokenizer.tools.llama3 import Llama3JsonParser
from services.tokenizer.tools.mistral import MistralParser
from services.tokenizer.tools.pythonic import PythonicParser

PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesParser, "qwen25": HermesParser, "qwen3": HermesParser,
    "llama3_json": Llama3JsonParser, "llama3": Llama3JsonParser, "llama4_json": Llama3JsonParser,
    "mistral": MistralParser,
    "pythonic": PythonicParser, "llama4_pythonic": PythonicParser,
    "deepseek_v3": DeepSeekV3Parser, "deepseek_v31": DeepSeekV3Parser,
}
TOOL_PARSER_CHOICES = ("auto", "none", *PARSERS)

# What a chat template that renders tool calls says about its model's format: a marker only
# one format uses. A template matching none or several is not guessed at.
_SIGNS: dict[str, tuple[str, ...]] = {
    "hermes": ("<tool_call>",),
    "mistral": ("[TOOL_CALLS]",),
    "deepseek_v3": ("<｜tool▁calls▁begin｜>",),
    "llama3_json": ("<|python_tag|>", '"parameters": '),
}


def detect(chat_template: str | None) -> str | None:
    """The parser a chat template implies, when exactly one format's marker is in it."""
    if not chat_template or "tools" not in chat_template:
        return None
    found = [name for name, signs in _SIGNS.items() if any(s in chat_template for s in signs)]
    return found[0] if len(found) == 1 else None


def resolve(flag: str, chat_template: str | None) -> str | None:
    """``--tool-call-parser``: a parser name, ``none`` (off) or ``auto`` (detected from the template)."""
    if flag == "none":
        return None
    if flag in ("", "auto"):
        return detect(chat_template)
    if flag not in PARSERS:
        raise ValueError(f"unknown tool call parser {flag!r} (one of {', '.join(TOOL_PARSER_CHOICES)})")
    return flag


__all__ = ["PARSERS", "Piece", "TOOL_PARSER_CHOICES", "ToolCallDelta", "ToolParser", "detect", "resolve"]
