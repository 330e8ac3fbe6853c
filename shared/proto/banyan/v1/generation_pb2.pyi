from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
    FINISH_REASON_TOOL_CALLS: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
FINISH_REASON_TOOL_CALLS: FinishReason

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "tool_calls", "tool_call_id", "reasoning_content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    REASONING_CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    tool_call_id: str
    reasoning_content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., tool_call_id: _Optional[str] = ..., reasoning_content: _Optional[str] = ...) -> None: ...

class ToolCall(_message.Message):
    __slots__ = ("id", "name", "arguments")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    arguments: str
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., arguments: _Optional[str] = ...) -> None: ...

class Tool(_message.Message):
    __slots__ = ("name", "description", "parameters", "strict")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    STRICT_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    parameters: str
    strict: bool
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., parameters: _Optional[str] = ..., strict: _Optional[bool] = ...) -> None: ...

class ToolCallDelta(_message.Message):
    __slots__ = ("index", "id", "name", "arguments")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    index: int
    id: str
    name: str
    arguments: str
    def __init__(self, index: _Optional[int] = ..., id: _Optional[str] = ..., name: _Optional[str] = ..., arguments: _Optional[str] = ...) -> None: ...

class ChatInput(_message.Message):
    __slots__ = ("messages", "add_generation_prompt")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    add_generation_prompt: bool
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., add_generation_prompt: _Optional[bool] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos", "skip_special_tokens", "n", "presence_penalty", "frequency_penalty", "logprobs", "top_logprobs", "stream_interval", "prompt_logprobs_start", "prompt_top_logprobs", "logit_bias", "min_tokens", "repetition_penalty")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STREAM_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_START_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    skip_special_tokens: bool
    n: int
    presence_penalty: float
    frequency_penalty: float
    logprobs: bool
    top_logprobs: int
    stream_interval: int
    prompt_logprobs_start: int
    prompt_top_logprobs: int
    logit_bias: _containers.ScalarMap[int, float]
    min_tokens: int
    repetition_penalty: float
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., skip_special_tokens: _Optional[bool] = ..., n: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., stream_interval: _Optional[int] = ..., prompt_logprobs_start: _Optional[int] = ..., prompt_top_logprobs: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., min_tokens: _Optional[int] = ..., repetition_penalty: _Optional[float] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "chat", "sampling_params", "cache_salt", "json_schema", "regex", "ebnf", "choice", "json_object", "priority", "session_id", "session_parent", "tools", "tool_choice", "tool_choice_function", "parallel_tool_calls", "chat_template_kwargs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    EBNF_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_PARENT_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_FUNCTION_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_KWARGS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: TokenIds
    chat: ChatInput
    sampling_params: SamplingParams
    cache_salt: str
    json_schema: str
    regex: str
    ebnf: str
    choice: Choices
    json_object: bool
    priority: int
    session_id: str
    session_parent: str
    tools: _containers.RepeatedCompositeFieldContainer[Tool]
    tool_choice: str
    tool_choice_function: str
    parallel_tool_calls: bool
    chat_template_kwargs: str
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., chat: _Optional[_Union[ChatInput, _Mapping]] = ..., sampling_params: _Optional[_Union[SamplingParams, _Mapping]] = ..., cache_salt: _Optional[str] = ..., json_schema: _Optional[str] = ..., regex: _Optional[str] = ..., ebnf: _Optional[str] = ..., choice: _Optional[_Union[Choices, _Mapping]] = ..., json_object: _Optional[bool] = ..., priority: _Optional[int] = ..., session_id: _Optional[str] = ..., session_parent: _Optional[str] = ..., tools: _Optional[_Iterable[_Union[Tool, _Mapping]]] = ..., tool_choice: _Optional[str] = ..., tool_choice_function: _Optional[str] = ..., parallel_tool_calls: _Optional[bool] = ..., chat_template_kwargs: _Optional[str] = ...) -> None: ...

class Choices(_message.Message):
    __slots__ = ("choices",)
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    choices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, choices: _Optional[_Iterable[str]] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class GeneratedTokenLogprobs(_message.Message):
    __slots__ = ("token", "top")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token: TokenLogprob
    top: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, token: _Optional[_Union[TokenLogprob, _Mapping]] = ..., top: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "finish_reason", "usage", "matched_stop", "matched_stop_token_id", "index", "logprobs", "prompt_logprobs", "reasoning_text", "tool_calls")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    MATCHED_STOP_FIELD_NUMBER: _ClassVar[int]
    MATCHED_STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    REASONING_TEXT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: FinishReason
    usage: Usage
    matched_stop: str
    matched_stop_token_id: int
    index: int
    logprobs: _containers.RepeatedCompositeFieldContainer[GeneratedTokenLogprobs]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[PromptTokenLogprobs]
    reasoning_text: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCallDelta]
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., matched_stop: _Optional[str] = ..., matched_stop_token_id: _Optional[int] = ..., index: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[GeneratedTokenLogprobs, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[PromptTokenLogprobs, _Mapping]]] = ..., reasoning_text: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCallDelta, _Mapping]]] = ...) -> None: ...

class PromptTokenLogprobs(_message.Message):
    __slots__ = ("token_id", "logprob", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("text", "chat", "add_special_tokens")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    text: str
    chat: ChatInput
    add_special_tokens: bool
    def __init__(self, text: _Optional[str] = ..., chat: _Optional[_Union[ChatInput, _Mapping]] = ..., add_special_tokens: _Optional[bool] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("token_ids", "tokens")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    tokens: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., tokens: _Optional[_Iterable[str]] = ...) -> None: ...

class DetokenizeRequest(_message.Message):
    __slots__ = ("token_ids", "skip_special_tokens")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    skip_special_tokens: bool
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., skip_special_tokens: _Optional[bool] = ...) -> None: ...

class DetokenizeResponse(_message.Message):
    __slots__ = ("text",)
    TEXT_FIELD_NUMBER: _ClassVar[int]
    text: str
    def __init__(self, text: _Optional[str] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetModelInfoResponse(_message.Message):
    __slots__ = ("model", "architecture", "vocab_size", "context_length", "kv_pool_tokens", "max_running_requests", "device", "dtype", "eos_token_ids", "data_parallel_size")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    KV_POOL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DATA_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    model: str
    architecture: str
    vocab_size: int
    context_length: int
    kv_pool_tokens: int
    max_running_requests: int
    device: str
    dtype: str
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    data_parallel_size: int
    def __init__(self, model: _Optional[str] = ..., architecture: _Optional[str] = ..., vocab_size: _Optional[int] = ..., context_length: _Optional[int] = ..., kv_pool_tokens: _Optional[int] = ..., max_running_requests: _Optional[int] = ..., device: _Optional[str] = ..., dtype: _Optional[str] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., data_parallel_size: _Optional[int] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class ScoreRequest(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "chat", "continuations", "cache_salt")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    CONTINUATIONS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: TokenIds
    chat: ChatInput
    continuations: _containers.RepeatedScalarFieldContainer[str]
    cache_salt: str
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., chat: _Optional[_Union[ChatInput, _Mapping]] = ..., continuations: _Optional[_Iterable[str]] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class ContinuationScore(_message.Message):
    __slots__ = ("tokens", "logprob_sum", "logprob_mean", "cached_tokens")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_SUM_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_MEAN_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    logprob_sum: float
    logprob_mean: float
    cached_tokens: int
    def __init__(self, tokens: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., logprob_sum: _Optional[float] = ..., logprob_mean: _Optional[float] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class ScoreResponse(_message.Message):
    __slots__ = ("request_id", "scores", "prompt_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SCORES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    scores: _containers.RepeatedCompositeFieldContainer[ContinuationScore]
    prompt_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., scores: _Optional[_Iterable[_Union[ContinuationScore, _Mapping]]] = ..., prompt_tokens: _Optional[int] = ...) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetLoadResponse(_message.Message):
    __slots__ = ("num_running_requests", "num_waiting_requests", "kv_free_tokens", "kv_used_tokens", "kv_pool_tokens", "steps", "prefill_computed_tokens", "prefill_cached_tokens", "decode_tokens", "retractions", "evicted_tokens", "kv_evictable_tokens", "jump_forward_tokens", "groups", "preemptions", "shed_requests", "num_sessions", "session_tokens", "num_pinned_prefixes", "pinned_tokens", "max_pinned_tokens", "host_cached_tokens", "disk_cached_tokens", "host_pool_tokens", "host_used_tokens", "disk_capacity_bytes", "disk_used_bytes", "tier_stored_tokens", "tier_loaded_tokens", "disk_written_tokens", "disk_read_tokens", "tier_failures")
    NUM_RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    KV_FREE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_USED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_POOL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DECODE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RETRACTIONS_FIELD_NUMBER: _ClassVar[int]
    EVICTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_EVICTABLE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    JUMP_FORWARD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    SHED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    SESSION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_PINNED_PREFIXES_FIELD_NUMBER: _ClassVar[int]
    PINNED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_PINNED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HOST_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DISK_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HOST_POOL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HOST_USED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DISK_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    TIER_STORED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIER_LOADED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DISK_WRITTEN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DISK_READ_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIER_FAILURES_FIELD_NUMBER: _ClassVar[int]
    num_running_requests: int
    num_waiting_requests: int
    kv_free_tokens: int
    kv_used_tokens: int
    kv_pool_tokens: int
    steps: int
    prefill_computed_tokens: int
    prefill_cached_tokens: int
    decode_tokens: int
    retractions: int
    evicted_tokens: int
    kv_evictable_tokens: int
    jump_forward_tokens: int
    groups: _containers.RepeatedCompositeFieldContainer[GetLoadResponse]
    preemptions: int
    shed_requests: int
    num_sessions: int
    session_tokens: int
    num_pinned_prefixes: int
    pinned_tokens: int
    max_pinned_tokens: int
    host_cached_tokens: int
    disk_cached_tokens: int
    host_pool_tokens: int
    host_used_tokens: int
    disk_capacity_bytes: int
    disk_used_bytes: int
    tier_stored_tokens: int
    tier_loaded_tokens: int
    disk_written_tokens: int
    disk_read_tokens: int
    tier_failures: int
    def __init__(self, num_running_requests: _Optional[int] = ..., num_waiting_requests: _Optional[int] = ..., kv_free_tokens: _Optional[int] = ..., kv_used_tokens: _Optional[int] = ..., kv_pool_tokens: _Optional[int] = ..., steps: _Optional[int] = ..., prefill_computed_tokens: _Optional[int] = ..., prefill_cached_tokens: _Optional[int] = ..., decode_tokens: _Optional[int] = ..., retractions: _Optional[int] = ..., evicted_tokens: _Optional[int] = ..., kv_evictable_tokens: _Optional[int] = ..., jump_forward_tokens: _Optional[int] = ..., groups: _Optional[_Iterable[_Union[GetLoadResponse, _Mapping]]] = ..., preemptions: _Optional[int] = ..., shed_requests: _Optional[int] = ..., num_sessions: _Optional[int] = ..., session_tokens: _Optional[int] = ..., num_pinned_prefixes: _Optional[int] = ..., pinned_tokens: _Optional[int] = ..., max_pinned_tokens: _Optional[int] = ..., host_cached_tokens: _Optional[int] = ..., disk_cached_tokens: _Optional[int] = ..., host_pool_tokens: _Optional[int] = ..., host_used_tokens: _Optional[int] = ..., disk_capacity_bytes: _Optional[int] = ..., disk_used_bytes: _Optional[int] = ..., tier_stored_tokens: _Optional[int] = ..., tier_loaded_tokens: _Optional[int] = ..., disk_written_tokens: _Optional[int] = ..., disk_read_tokens: _Optional[int] = ..., tier_failures: _Optional[int] = ...) -> None: ...

class OpenSessionRequest(_message.Message):
    __slots__ = ("ttl_seconds", "capacity", "cache_salt")
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    ttl_seconds: int
    capacity: int
    cache_salt: str
    def __init__(self, ttl_seconds: _Optional[int] = ..., capacity: _Optional[int] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class OpenSessionResponse(_message.Message):
    __slots__ = ("session_id", "ttl_seconds", "capacity")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    ttl_seconds: int
    capacity: int
    def __init__(self, session_id: _Optional[str] = ..., ttl_seconds: _Optional[int] = ..., capacity: _Optional[int] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class CloseSessionResponse(_message.Message):
    __slots__ = ("tokens",)
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens: int
    def __init__(self, tokens: _Optional[int] = ...) -> None: ...

class PinPrefixRequest(_message.Message):
    __slots__ = ("text", "token_ids", "chat", "ttl_seconds", "cache_salt")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: TokenIds
    chat: ChatInput
    ttl_seconds: int
    cache_salt: str
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., chat: _Optional[_Union[ChatInput, _Mapping]] = ..., ttl_seconds: _Optional[int] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class PinPrefixResponse(_message.Message):
    __slots__ = ("pin_id", "tokens", "cached_tokens")
    PIN_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    pin_id: str
    tokens: int
    cached_tokens: int
    def __init__(self, pin_id: _Optional[str] = ..., tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class UnpinPrefixRequest(_message.Message):
    __slots__ = ("pin_id",)
    PIN_ID_FIELD_NUMBER: _ClassVar[int]
    pin_id: str
    def __init__(self, pin_id: _Optional[str] = ...) -> None: ...

class UnpinPrefixResponse(_message.Message):
    __slots__ = ("tokens",)
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens: int
    def __init__(self, tokens: _Optional[int] = ...) -> None: ...
