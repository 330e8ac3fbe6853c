"""Pydantic models of SGLang's native HTTP API (``POST /generate``, ``/abort_request``, …), with
SGLang's field names. They fix JSON types only; what Banyan cannot do is refused by name in
``convert.py`` and value rules live in ``validation.py``.

A request may carry fields SGLang has and Banyan does not (multimodal inputs, LoRA, hidden states,
disaggregation …): the models keep unknown fields (``extra="allow"``) so that ``convert.py`` can say
which one is not supported rather than failing on the first unknown key.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from services.tokenizer.http.protocol import Int32, Int64, Text, TokenId

# The paths this API serves (for the request metrics' endpoint label)
PATHS = frozenset({"/generate", "/get_model_info", "/model_info", "/server_info", "/get_server_info",
                   "/flush_cache", "/abort_request", "/health_generate", "/open_session", "/close_session"})
OPEN_PATHS = frozenset({"/health_generate"})  # health stays open, as /health

IdList = list[TokenId]


class SamplingParams(BaseModel):
    """``sampling_params`` of ``/generate`` (SGLang's ``SamplingParams`` names). ``None`` = not given."""

    model_config = ConfigDict(extra="allow")
    max_new_tokens: Int32 | None = Field(None, description="0: prefill only (the prompt is computed and "
                                         "cached; its log-probs returned when asked); default 128")
    min_new_tokens: Int32 | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int32 | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    stop: Text | list[Text] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    n: Int32 | None = None
    regex: Text | None = None
    json_schema: Text | None = None
    ebnf: Text | None = None
    logit_bias: dict[str, float] | None = None
    sampling_seed: Int64 | None = None
    seed: Int64 | None = None
    stream_interval: Int32 | None = None


class GenerateRequest(BaseModel):
    """``POST /generate``: one prompt (``text`` or ``input_ids``) or a batch (a list of them)."""

    model_config = ConfigDict(extra="allow")
    text: Text | list[Text] | None = None
    input_ids: IdList | list[IdList] | None = None
    sampling_params: SamplingParams | list[SamplingParams] | None = None
    rid: Text | list[Text] | None = None
    return_logprob: bool | list[bool] | None = None
    logprob_start_len: Int32 | list[Int32] | None = None
    top_logprobs_num: Int32 | list[Int32] | None = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    priority: Int32 | None = None
    session_params: SessionParams | None = None
    data_parallel_rank: Int32 | None = None
    log_metrics: bool = True
    no_logs: bool = False


class SessionParams(BaseModel):
    """``session_params``: continue a session (``POST /open_session`` or ``/v1/sessions``)."""

    model_config = ConfigDict(extra="allow")
    id: Text
    rid: Text | None = Field(None, description="the turn to continue (branching); default the latest")
    offset: Int32 | None = None
    replace: bool | None = None
    drop_previous_output: bool | None = None


class AbortRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    rid: Text = ""
    abort_all: bool = False


class OpenSessionRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    capacity_of_str_len: Annotated[int, Field(ge=1, le=2**31 - 1)] | None = None
    session_id: Text | None = None


class CloseSessionRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    session_id: Text


GenerateRequest.model_rebuild()
