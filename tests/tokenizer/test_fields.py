"""The field policy (``services/tokenizer/http/fields.py``) against the request models and
docs/openai.md, and the 400s of the HTTP front's edge: strict types, nulls, roles, missing
content, the ``param`` of each message (no server)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from services.tokenizer.http import fields
from services.tokenizer.http import protocol as api
from services.tokenizer.http.errors import _validation_message, param_of

DOC = Path(__file__).resolve().parents[2] / "docs" / "openai.md"
MODELS = {fields.CHAT: api.ChatCompletionRequest, fields.COMPLETIONS: api.CompletionRequest}


def _models():
    from services.tokenizer.http import responses_api
    return MODELS | {fields.RESPONSES: responses_api.ResponseRequest}


@pytest.mark.parametrize("endpoint", list(fields.ENDPOINTS))
def test_models_declare_exactly_the_accepted_fields(endpoint):
    declared = set(_models()[endpoint].model_fields)
    assert declared == fields.accepted(endpoint), (
        f"update services/tokenizer/http/fields.py: declared only {declared - fields.accepted(endpoint)}, "
        f"in the policy only {fields.accepted(endpoint) - declared}")


def test_every_refused_or_ignored_field_has_an_example_and_refused_ones_a_reason():
    for r in fields.RULES:
        if r.policy in (fields.Policy.REFUSED, fields.Policy.IGNORED):
            assert r.example is not None, r.name
        if r.policy in (fields.Policy.REFUSED, fields.Policy.LIMITED):
            assert r.note, r.name


def test_docs_table_is_the_registry():
    text = DOC.read_text()
    table = text.split("<!-- fields:begin -->\n", 1)[1].split("<!-- fields:end -->", 1)[0]
    assert table == fields.markdown(), "regenerate it: python3 -m services.tokenizer.http.fields (rewrites the table)"


def _message(model, body: dict, endpoint: str = fields.CHAT) -> tuple[str, str | None]:
    with pytest.raises(ValidationError) as e:
        model.model_validate(body)
    return _validation_message(RequestValidationError([dict(x, loc=("body", *x["loc"])) for x in e.value.errors()]),
                               endpoint)


CHAT_OK = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("body, param, words", [
    ({**CHAT_OK, "max_tokens": "10"}, "max_tokens", "valid integer"),
    ({**CHAT_OK, "max_tokens": True}, "max_tokens", "valid integer"),
    ({**CHAT_OK, "temperature": "0.5"}, "temperature", "valid number"),
    ({**CHAT_OK, "n": 1.5}, "n", "valid integer"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role", "'assistant'"),
    ({"messages": [{"role": "user"}]}, "messages.0.content", "content is required"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": None}]},
     "messages.1.content", "content is required"),
    ({}, "messages", "messages: is required"),
    ({**CHAT_OK, "audio": {"voice": "alloy"}}, "audio", "audio is not supported by this server: text models"),
    ({**CHAT_OK, "frobnicate": 1}, "frobnicate", "unrecognized request argument"),
    ({**CHAT_OK, "modalities": ["text", "audio"]}, "modalities.1", "'text'"),
    ({**CHAT_OK, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage", "valid boolean"),
])
def test_validation_errors_name_their_field(body, param, words):
    message, got = _message(api.ChatCompletionRequest, body)
    assert got == param and words in message and message.startswith(param), (message, got)


def test_nulls_are_not_given():
    req = api.ChatCompletionRequest.model_validate({**CHAT_OK, "stream": None, "skip_special_tokens": None,
                                                    "n": None, "user": None})
    assert (req.stream, req.skip_special_tokens, req.n) == (False, True, None)
    c = api.CompletionRequest.model_validate({"prompt": "x", "max_tokens": None, "echo": None})
    assert c.max_tokens is None and c.echo is False  # (completions: null max_tokens = up to the context window)


@pytest.mark.parametrize("message, endpoint, param", [
    ("max_tokens must be >= 1", fields.CHAT, "max_tokens"),
    ("max_tokens=9 with a 5-token prompt exceeds the context window", fields.COMPLETIONS, "max_tokens"),
    ("messages[0].role 'x' is not a role name", fields.CHAT, "messages.0.role"),
    ("the prompt has 5000 tokens; the context window is 4096", fields.COMPLETIONS, "prompt"),
    ("the prompt has 5000 tokens; the context window is 4096", fields.CHAT, "messages"),
    ("top_logprobs requires logprobs to be true", fields.CHAT, "top_logprobs"),
    ("seed must be in [0, 18446744073709551615]", fields.CHAT, "seed"),
    ("n must be in [1, 64], got 0", fields.CHAT, "n"),
    ("stop has 17 strings (at most 16)", fields.COMPLETIONS, "stop"),
    ("stop_token_ids: 10000000 is out of the vocabulary [0, 1000)", fields.COMPLETIONS, "stop_token_ids"),
    ("give at most one of response_format (json_object / json_schema), regex, ebnf and choice", fields.CHAT,
     "response_format"),
    ("temperature must be >= 0, got -1", fields.CHAT, "temperature"),
    ("top_p must be in (0, 1], got 0", fields.CHAT, "top_p"),
    ("something else entirely", fields.CHAT, None),
    ("the model's chat template cannot render these messages as the continuation", fields.CHAT, "messages"),
    ("chat template failed: Conversation roles must alternate user/assistant", fields.CHAT, "messages"),
    ("input[2].role must be one of user, system, developer, assistant", fields.RESPONSES, "input.2.role"),
    ("tools[0].function.name 'a b' must be 1-64 letters", fields.CHAT, "tools.0.function.name"),
    ("tool_choice required needs tools", fields.RESPONSES, "tool_choice"),
    ("the prompt text must not be empty", fields.COMPLETIONS, "prompt"),
])
def test_param_of_a_validation_message(message, endpoint, param):
    assert param_of(message, endpoint) == param


def test_markdown_lists_every_field_once():
    rows = [line for line in fields.markdown().splitlines()[2:]]
    names = [re.match(r"\| `([^`]+)`", r).group(1) for r in rows]
    assert len(names) == len(set(names)) == len({r.name for r in fields.RULES})
