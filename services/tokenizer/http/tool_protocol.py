"""Pydantic models of tool calling and reasoning output in the chat API (OpenAI's shapes): the
``tools`` and ``tool_choice`` of a request, tool turns of its history, and the ``tool_calls`` /
``reasoning_content`` of answers and stream deltas."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


def _none(v: object) -> bool:
    return v is None


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FunctionDefinition(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON schema of the arguments (default: any object)")
    strict: bool | None = Field(None, description="the arguments follow the schema under tool_choice auto too")


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(BaseModel):
    name: str
    arguments: str = Field(description="the arguments as a JSON string")


class ToolCall(BaseModel):
    """A call in an answer, or in an assistant turn of the history (``index``: what stream
    accumulators leave in it, ignored)."""

    model_config = ConfigDict(extra="ignore")
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionCallDelta(BaseModel):
    name: str | None = Field(None, exclude_if=_none)
    arguments: str | None = Field(None, exclude_if=_none)


class ToolCallChunk(BaseModel):
    """A piece of a streamed call: the first carries its id, type and name; later ones pieces of
    its arguments, which concatenate to the non-streamed call's."""

    index: int
    id: str | None = Field(None, exclude_if=_none)
    type: Literal["function"] | None = Field(None, exclude_if=_none)
    function: FunctionCallDelta


# the fields answers and deltas gain (absent from the JSON when empty)
TOOL_CALLS = Field(None, exclude_if=_none)
REASONING = Field(None, exclude_if=_none, description="the thinking part (--reasoning-parser)")
