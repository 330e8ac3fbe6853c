"""The field policy of the OpenAI-compatible HTTP API: every field of OpenAI's spec and of the common
vLLM / SGLang extensions, per endpoint, with what Banyan does with it.

- ``HONOURED``: it does what the spec (or the extension's origin) says.
- ``IGNORED``: accepted and changes nothing here (``store``, ``metadata``, ``user`` …: they only mean
  something to OpenAI's platform).
- ``LIMITED``: accepted with the values Banyan can honour; any other value is a 400 naming the field.
- ``REFUSED``: a 400 naming the field and saying why (Banyan cannot honour its meaning).

Any field not listed is a 400 too ("unrecognized request argument"), and ``null`` is "not given"
for every optional field. ``docs/openai.md``'s table is made from this registry (``markdown()``;
``tests/tokenizer/test_fields.py`` checks the two agree, and that the request models accept exactly
the honoured, ignored and limited fields).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

CHAT, COMPLETIONS, RESPONSES = "chat", "completions", "responses"
ENDPOINTS = {CHAT: "/v1/chat/completions", COMPLETIONS: "/v1/completions", RESPONSES: "/v1/responses"}


class Policy(str, Enum):
    HONOURED = "honoured"
    IGNORED = "accepted, ignored"
    LIMITED = "limited"
    REFUSED = "refused (400)"


@dataclass(frozen=True)
class Rule:
    name: str
    policy: Policy
    endpoints: tuple[str, ...]
    note: str = ""
    example: object = None  # IGNORED / REFUSED: a value a client sends (the tests send it)


H, I, L, R = Policy.HONOURED, Policy.IGNORED, Policy.LIMITED, Policy.REFUSED
GEN = (CHAT, COMPLETIONS)
ALL = (CHAT, COMPLETIONS, RESPONSES)
_GUIDED = "use response_format, regex, ebnf or choice"

RULES: tuple[Rule, ...] = (
    # ---- OpenAI, both generation endpoints
    Rule("model", H, ALL, "the served model's name or an alias (--served-model-name); empty: the served model"),
    Rule("n", H, GEN, "choices per prompt, 1..64"),
    Rule("temperature", H, ALL),
    Rule("top_p", H, ALL),
    Rule("seed", H, ALL, "per choice i: seed + i (responses: Banyan's extension)"),
    Rule("stop", H, GEN, "up to 16 strings"),
    Rule("presence_penalty", H, GEN),
    Rule("frequency_penalty", H, GEN),
    Rule("stream", H, ALL, "server-sent events"),
    Rule("stream_options", H, GEN, "include_usage (a last chunk with usage), continuous_usage_stats (usage on "
                                   "every chunk, vLLM's extension); include_obfuscation is ignored"),
    Rule("logit_bias", H, GEN, "token id → bias, clamped to [-100, 100]"),
    Rule("response_format", H, GEN, "text, json_object, json_schema (grammar-constrained)"),
    Rule("user", I, ALL, example="user-1234"),
    Rule("metadata", I, ALL, example={"k": "v"}),
    Rule("store", I, ALL, example=False),
    Rule("service_tier", I, ALL, example="auto"),
    Rule("safety_identifier", I, ALL, example="hash-1"),
    Rule("prompt_cache_key", I, ALL, "the prefix cache needs no key (use cache_salt to separate tenants)",
         example="k1"),
    # ---- OpenAI, chat
    Rule("messages", H, (CHAT,), "roles system, developer (as system), user, assistant, tool; text content parts"),
    Rule("max_tokens", H, (CHAT, COMPLETIONS), "chat: the same as max_completion_tokens; completions: default 16"),
    Rule("max_completion_tokens", H, (CHAT,)),
    Rule("logprobs", H, GEN, "chat: true/false; completions: how many alternatives (0..20)"),
    Rule("top_logprobs", H, (CHAT,), "0..20, with logprobs: true"),
    Rule("parallel_tool_calls", H, (CHAT,), "false: at most one call (grammar-enforced under required / named)"),
    Rule("tools", H, (CHAT,), "function tools, rendered by the model's chat template; [] or null: none "
                              "(docs/tools.md)"),
    Rule("tool_choice", H, (CHAT,), "none, auto (needs --tool-call-parser or a template it detects), required, "
                                    "a named function; required / named and strict functions grammar-enforced"),
    Rule("functions", R, (CHAT,), "OpenAI's deprecated function calling: use tools",
         example=[{"name": "f", "parameters": {}}]),
    Rule("function_call", R, (CHAT,), "OpenAI's deprecated function calling: use tool_choice", example="auto"),
    Rule("reasoning_effort", I, (CHAT, RESPONSES), "the model reasons as its chat template says",
         example="low"),
    Rule("verbosity", I, (CHAT,), example="low"),
    Rule("modalities", L, (CHAT,), 'only ["text"]'),
    Rule("audio", R, (CHAT,), "text models only: no audio output", example={"voice": "alloy", "format": "wav"}),
    Rule("prediction", R, (CHAT,), "no predicted outputs (speculative decoding from a given text)",
         example={"type": "content", "content": "x"}),
    Rule("web_search_options", R, (CHAT,), "no web search", example={}),
    # ---- OpenAI, completions
    Rule("prompt", H, (COMPLETIONS,), "a string, a list of strings, token ids, or lists of token ids (64 prompts)"),
    Rule("echo", H, (COMPLETIONS,), "the prompt before the completion (its logprobs too, with logprobs; "
                                    "max_tokens 0 scores the prompt alone)"),
    Rule("suffix", L, (COMPLETIONS,), "only empty: no fill-in-the-middle"),
    Rule("best_of", L, (COMPLETIONS,), "only 1: use n for several completions"),
    # ---- Responses API
    Rule("input", H, (RESPONSES,), "a string or a list of messages (input_text parts), function_call and "
                                   "function_call_output items"),
    Rule("instructions", H, (RESPONSES,), "a system message before the input"),
    Rule("max_output_tokens", H, (RESPONSES,)),
    Rule("text", H, (RESPONSES,), "format: text, json_object, json_schema (grammar-constrained)"),
    Rule("stream_options", I, (RESPONSES,), "include_obfuscation: no obfuscation padding",
         example={"include_obfuscation": False}),
    Rule("previous_response_id", R, (RESPONSES,), "no stored responses: send the whole conversation as input",
         example="resp_123"),
    Rule("background", R, (RESPONSES,), "no background responses", example=True),
    Rule("conversation", R, (RESPONSES,), "no stored conversations: send the whole conversation as input",
         example="conv_123"),
    Rule("include", I, (RESPONSES,), example=["message.output_text.logprobs"]),
    Rule("truncation", L, (RESPONSES,), '"disabled" only (a prompt longer than the context window is a 400)'),
    Rule("reasoning", I, (RESPONSES,), example={"effort": "low"}),
    Rule("tools", H, (RESPONSES,), "function tools ({type: function, name, parameters, strict}); others are a 400"),
    Rule("tool_choice", H, (RESPONSES,), "none, auto, required, {type: function, name} (as chat's)"),
    Rule("parallel_tool_calls", H, (RESPONSES,), "false: at most one call"),
    Rule("max_tool_calls", I, (RESPONSES,), example=4),
    Rule("top_logprobs", R, (RESPONSES,), "no logprobs in responses: use /v1/chat/completions", example=2),
    # ---- vLLM / SGLang extensions
    Rule("top_k", H, GEN),
    Rule("min_p", H, GEN),
    Rule("ignore_eos", H, GEN),
    Rule("stop_token_ids", H, GEN),
    Rule("skip_special_tokens", H, GEN),
    Rule("min_tokens", H, GEN, "stop tokens (EOS too) masked until this many new tokens"),
    Rule("repetition_penalty", H, GEN, "HF's, over prompt and output, (0, 2]"),
    Rule("prompt_logprobs", H, GEN, "vLLM's: the prompt tokens' logprobs with k alternatives (0..20), not streamed"),
    Rule("regex", H, GEN, "grammar-constrained output"),
    Rule("ebnf", H, GEN, "grammar-constrained output (GBNF dialect)"),
    Rule("choice", H, GEN, "output one of these strings"),
    Rule("stream_interval", H, GEN, "stream tokens this many at a time"),
    Rule("cache_salt", H, GEN, "prefix-cache namespace"),
    Rule("priority", H, GEN, "with --enable-priority-scheduling"),
    Rule("session_id", H, GEN, "Banyan sessions (POST /v1/sessions)"),
    Rule("session_parent", H, GEN, "Banyan sessions: the turn to continue"),
    Rule("add_generation_prompt", H, (CHAT,)),
    Rule("spaces_between_special_tokens", I, GEN, example=True),
    Rule("guided_json", R, GEN, _GUIDED, example={"type": "object"}),
    Rule("guided_regex", R, GEN, _GUIDED, example="a+"),
    Rule("guided_choice", R, GEN, _GUIDED, example=["a"]),
    Rule("guided_grammar", R, GEN, _GUIDED, example="root ::= \"a\""),
    Rule("use_beam_search", R, GEN, "no beam search", example=True),
    Rule("length_penalty", R, GEN, "no beam search", example=1.2),
    Rule("include_stop_str_in_output", R, GEN, "the stop string is never part of the output", example=True),
    Rule("truncate_prompt_tokens", R, GEN, "prompts are never cut: a prompt longer than the context is a 400",
         example=10),
    Rule("allowed_token_ids", R, GEN, "use regex or choice", example=[1, 2]),
    Rule("bad_words", R, GEN, "no banned words", example=["x"]),
    Rule("return_tokens_as_token_ids", R, GEN, "not supported", example=True),
    Rule("logits_processors", R, GEN, "no custom logits processors", example=["x"]),
    Rule("chat_template", R, (CHAT,), "the model's own chat template is used", example="{{ messages }}"),
    Rule("chat_template_kwargs", H, (CHAT,), "more template variables (e.g. enable_thinking); not those the "
                                             "server sets (messages, tools, add_generation_prompt …)"),
    Rule("continue_final_message", R, (CHAT,), "use add_generation_prompt: false", example=True),
    Rule("documents", R, (CHAT,), "no RAG documents for the template", example=[{"text": "x"}]),
)


def rules(endpoint: str) -> dict[str, Rule]:
    return {r.name: r for r in RULES if endpoint in r.endpoints}


def refusal(endpoint: str, name: str) -> str | None:
    """The message for a refused field (``None``: not a refused field of that endpoint)."""
    r = rules(endpoint).get(name)
    if r is None or r.policy is not Policy.REFUSED:
        return None
    return f"{name} is not supported by this server: {r.note}"


def accepted(endpoint: str) -> set[str]:
    """The fields the endpoint's request model must declare."""
    return {n for n, r in rules(endpoint).items() if r.policy is not Policy.REFUSED}


def endpoint_of(path: str) -> str | None:
    return next((e for e, p in ENDPOINTS.items() if path == p), None)


def markdown() -> str:
    """The policy as the table of ``docs/openai.md``."""
    names = sorted({r.name for r in RULES}, key=lambda n: next(i for i, r in enumerate(RULES) if r.name == n))
    head = ["| field | " + " | ".join(f"`{p}`" for p in ENDPOINTS.values()) + " | note |",
            "| --- |" + " --- |" * len(ENDPOINTS) + " --- |"]
    lines = []
    for n in names:
        cells, notes = [], []
        for e in ENDPOINTS:
            r = rules(e).get(n)
            cells.append(r.policy.value if r else "—")
            if r and r.note and r.note not in notes:
                notes.append(r.note)
        lines.append(f"| `{n}` | " + " | ".join(cells) + " | " + "; ".join(notes) + " |")
    return "\n".join(head + lines) + "\n"


def write_doc(path: str = "docs/openai.md") -> None:
    """Put the table between the doc's ``<!-- fields:begin -->`` and ``<!-- fields:end -->`` lines."""
    with open(path) as f:
        text = f.read()
    head, rest = text.split("<!-- fields:begin -->\n", 1)
    tail = rest.split("<!-- fields:end -->", 1)[1]
    with open(path, "w") as f:
        f.write(head + "<!-- fields:begin -->\n" + markdown() + "<!-- fields:end -->" + tail)


if __name__ == "__main__":  # python3 -m services.tokenizer.http.fields: rewrite docs/openai.md's table
    write_doc()
