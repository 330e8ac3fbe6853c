"""The tool turns of a chat history (assistant ``tool_calls``, ``role: "tool"`` replies) as
``text.Message`` keeps them for the template."""

from __future__ import annotations

from services.tokenizer.http import protocol as api
from services.tokenizer.tools import request as tools_request


def message_fields(m: api.ChatMessage, i: int) -> dict:
    """A history message's tool fields, as ``text.Message`` keeps them."""
    out: dict = {}
    if m.tool_calls:
        out["tool_calls"] = tools_request.history_calls(
            [(c.id, c.function.name, c.function.arguments) for c in m.tool_calls], f"messages[{i}]")
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    if m.reasoning_content:
        out["reasoning_content"] = m.reasoning_content
    return out
