"""Pydantic models of the OpenAI-compatible HTTP API (they also make ``/openapi.json``).

Which fields each endpoint honours, ignores or refuses is ``fields.py``'s policy; these models declare
exactly the accepted ones (a test checks it). Unknown fields are a 400 naming them (as OpenAI does);
types are strict (``"max_tokens": "10"`` is a 400, not 10) and ``null`` is "not given" for every
optional field. Banyan's extensions carry the names vLLM and SGLang use (``top_k``, ``min_p``,
``ignore_eos``, ``stop_token_ids``, ``regex``, ``ebnf``, ``choice``, ``cache_salt`` …). Value rules live
in ``validation.py``, not here: these models only fix JSON types and the integer ranges of the wire.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from services.tokenizer.http.tool_protocol import REASONING, TOOL_CALLS, Tool, ToolCall, ToolCallChunk, ToolChoice


def _unicode(s: str) -> str:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:  # JSON can spell lone surrogates ("\ud800"); text cannot hold them
        raise ValueError("must be valid Unicode text (no lone surrogates)") from e
    return s


Text = Annotated[str, AfterValidator(_unicode)]
Int32 = Annotated[int, Field(ge=-(2**31), le=2**31 - 1)]
Int64 = Annotated[int, Field(ge=-(2**63), le=2**64 - 1)]  # seeds: validation takes [0, 2**64), folds to 2**63
TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]


def _nullable(annotation: Any) -> bool:
    if annotation is None or annotation is type(None) or annotation is Any:
        return True
    return any(_nullable(a) for a in getattr(annotation, "__args__", ()) if not isinstance(a, (str, int)))


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, data: Any) -> Any:
        """``"field": null`` means "not given" for a field that has a default but no null value."""
        if isinstance(data, dict):
            fields = cls.model_fields
            return {k: v for k, v in data.items() if not (
                v is None and k in fields and not fields[k].is_required() and not _nullable(fields[k].annotation))}
        return data


class ContentPart(BaseModel):
    """One part of a message's content; only ``{"type": "text", "text": ...}`` is supported."""

    model_config = ConfigDict(extra="allow")
    type: str
    text: Text | None = None


Role = Literal["system", "developer", "user", "assistant", "tool", "function"]


class ChatMessage(_Request):
    role: Role = Field(description="developer is given to the chat template as system")
    content: Text | list[ContentPart] | None = None
    name: Text | None = None  # accepted, not passed to the template
    tool_calls: list[ToolCall] | None = None  # an assistant turn's calls (to the template)
    tool_call_id: Text | None = None  # a tool turn: the call it answers
    reasoning_content: Text | None = None  # an assistant turn's thinking (templates that render it)

    @model_validator(mode="after")
    def _has_content(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and getattr(self, "tool_calls", None)):
            raise PydanticCustomError("missing_content", "content is required (role {role})",
                                      {"role": self.role})
        return self


class JsonSchemaFormat(_Request):
    name: str = ""
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = Field(False, description="vLLM's extension: usage so far on every chunk")
    include_obfuscation: bool | None = Field(None, description="accepted, ignored (no obfuscation padding)")


class _Generate(_Request):
    """Fields common to chat and text completions."""

    model: str = Field("", description="the served model's name; empty or omitted: the served model")
    n: Int32 | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: Int64 | None = None
    stop: Text | list[Text] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = Field(None, description="token id → bias added to its logit (clamped to "
                                                "[-100, 100])")
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    response_format: ResponseFormat | None = None
    # Extensions (vLLM / SGLang names)
    top_k: Int32 | None = Field(None, description="sample from the k most likely tokens (-1 or 0: off)")
    min_p: float | None = Field(None, description="drop tokens below min_p × the top probability")
    ignore_eos: bool = Field(False, description="keep generating past EOS tokens")
    stop_token_ids: list[TokenId] | None = Field(None, description="token ids that end a choice")
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool | None = Field(None, description="accepted, ignored")
    min_tokens: Int32 | None = Field(None, description="no stop token (EOS included) before this many new tokens")
    repetition_penalty: float | None = Field(None, description="HF's, over prompt + output, in (0, 2]; 1 = off")
    prompt_logprobs: Int32 | None = Field(None, description="vLLM's: the prompt tokens' log-probs with this many "
                                          "alternatives each, 0..20 (not with stream)")
    stream_interval: Int32 | None = Field(None, description="stream tokens this many at a time, in [1, 1024] "
                                          "(the first at once; default 1)")
    cache_salt: Text = Field("", description="prefix-cache namespace: requests share cached KV only within one")
    regex: Text | None = Field(None, description="constrain the output to this regular expression")
    ebnf: Text | None = Field(None, description="constrain the output to this EBNF grammar (GBNF dialect)")
    choice: list[Text] | None = Field(None, description="constrain the output to one of these strings")
    priority: Int32 | None = Field(None, description="scheduling priority in [-1000, 1000], higher = more urgent "
                                   "(default 0, or the x-banyan-priority header); used with the server's "
                                   "--enable-priority-scheduling")
    session_id: Text | None = Field(None, description="continue this session (POST /v1/sessions): the prompt is "
                                    "its tokens + this request's messages or prompt, which join it")
    session_parent: Text | None = Field(None, description="with session_id: the request id of the turn to continue "
                                        "(branching); default the latest")


class ChatCompletionRequest(_Generate):
    messages: list[ChatMessage]
    max_tokens: Int32 | None = Field(None, description="deprecated by OpenAI for max_completion_tokens")
    max_completion_tokens: Int32 | None = None
    logprobs: bool = False
    top_logprobs: Int32 | None = None
    parallel_tool_calls: bool | None = Field(None, description="let the model make several calls (default true)")
    tools: list[Tool] | None = Field(None, description="functions the model may call (docs/tools.md)")
    tool_choice: ToolChoice | None = Field(None, description="none | auto | required | {type: function, function: "
                                           "{name}}; default auto with tools, none without")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="more variables for the chat template "
                                                        "(e.g. enable_thinking)")
    reasoning_effort: str | None = Field(None, description="accepted, ignored: the model reasons as its template says")
    verbosity: str | None = None
    modalities: list[Literal["text"]] | None = None
    add_generation_prompt: bool = Field(True, description="end the prompt with the assistant's turn header")


class CompletionRequest(_Generate):
    prompt: Text | list[Text] | list[TokenId] | list[list[TokenId]]
    max_tokens: Int32 | None = Field(16, description="OpenAI's default is 16; null: up to the context window")
    logprobs: Int32 | None = Field(None, description="return this many most likely tokens per position")
    echo: bool = Field(False, description="the prompt (and with logprobs its logprobs) before the completion")
    suffix: Text | None = Field(None, description="not supported")
    best_of: Int32 | None = Field(None, description="only 1 is supported")


class SessionRequest(_Request):
    ttl_seconds: Int32 | None = Field(None, description="seconds without a turn before it expires (default 600)")
    capacity: Int32 | None = Field(None, description="most tokens it may hold (default: the context window, or "
                                   "the pinned-token budget when smaller)")
    cache_salt: Text = Field("", description="prefix-cache namespace of its turns")


class TokenizeRequest(_Request):
    model: str = ""
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Request):
    model: str = ""
    tokens: list[TokenId]
    skip_special_tokens: bool = True


# ----- responses -----

class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]  # (None: an echoed prompt's first token)
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


FinishReason = Literal["stop", "length", "abort", "tool_calls"]
StopReason = Annotated[str | int | None, Field(description="the stop string or stop token id that ended the choice")]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = TOOL_CALLS
    reasoning_content: str | None = REASONING
    reasoning: str | None = REASONING


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None
    stop_reason: StopReason = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: list[dict[str, Any] | None] | None = Field(None, description="vLLM's prompt_logprobs")


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallChunk] | None = TOOL_CALLS
    reasoning_content: str | None = REASONING
    reasoning: str | None = REASONING


class ChatChunkChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: StopReason = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: StopReason = None
    prompt_logprobs: list[dict[str, Any] | None] | None = Field(None, description="vLLM's prompt_logprobs")


class Completion(BaseModel):
    """A text completion, or (``usage`` absent until the last one) one chunk of a stream."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "banyan"
    max_model_len: int
    vocab_size: int = Field(description="Banyan extension: token ids are in [0, vocab_size) (banyan bench asks it)")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    tokens: list[int]
    token_strs: list[str]
    count: int
    max_model_len: int


class DetokenizeResponse(BaseModel):
    prompt: str


class Session(BaseModel):
    id: str
    object: Literal["session"] = "session"
    ttl_seconds: int
    capacity: int


class SessionDeleted(BaseModel):
    id: str
    object: Literal["session.deleted"] = "session.deleted"
    deleted: bool = True
    tokens: int = Field(description="tokens it held pinned")


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail
