"""Pydantic models of ``POST /v1/responses`` (OpenAI's Responses API): the request, the response
object and its output items. The request's fields follow ``fields.py``'s policy like the others."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from services.tokenizer.http.protocol import Int32, Int64, Text, _Request


class TextFormat(_Request):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextOptions(_Request):
    format: TextFormat | None = None
    verbosity: str | None = None


class FunctionTool(_Request):
    """A Responses-API function tool (flat: no nested ``function`` object, unlike chat's)."""

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(_Request):
    type: Literal["function"]
    name: str


class ResponseStreamOptions(_Request):
    include_obfuscation: bool | None = None


class ResponseRequest(_Request):
    model: str = Field("", description="the served model's name; empty or omitted: the served model")
    input: Text | list[dict[str, Any]] = Field(description="a string (one user message) or a list of input items: "
                                               "messages, function_call and function_call_output items")
    instructions: Text | None = Field(None, description="a system message before the input")
    max_output_tokens: Int32 | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    stream_options: ResponseStreamOptions | None = None
    text: TextOptions | None = None
    tools: list[FunctionTool] | None = Field(None, description="function tools (docs/tools.md: the server's "
                                            "--tool-call-parser reads the calls)")
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    max_tool_calls: Int32 | None = None
    truncation: Literal["disabled"] | None = None
    include: list[str] | None = None
    reasoning: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    seed: Int64 | None = Field(None, description="Banyan extension: the sampling seed")


# ----- the response object -----

class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = []
    logprobs: list[Any] = []


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class FunctionCall(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(BaseModel):
    """The thinking part of the answer (``--reasoning-parser``)."""

    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[Any] = []
    content: list[ReasoningText] = []
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


class InputTokensDetails(BaseModel):
    cached_tokens: int


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = OutputTokensDetails()
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class Response(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    model: str
    output: list[ReasoningItem | OutputMessage | FunctionCall]
    usage: ResponseUsage | None = None
    incomplete_details: IncompleteDetails | None = None
    error: dict[str, Any] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    store: bool = False
    temperature: float | None = None
    text: dict[str, Any] = {"format": {"type": "text"}}
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = []
    top_p: float | None = None
    truncation: Literal["disabled"] = "disabled"
    user: str | None = None
    metadata: dict[str, str] = {}
