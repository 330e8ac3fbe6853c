"""The request side of tool calling, front-neutral: the tools and ``tool_choice`` checked into a
``ToolPlan`` (what the chat template gets, which parser reads the output, the grammar that
enforces the choice), and the tool turns of a history made ready for the template."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from shared.errors import InvalidArgument
from shared.messages.common import Constraint
from services.tokenizer.tools import grammar

NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
MAX_TOOLS = 128
MAX_TOOLS_JSON = 1 << 20  # characters of the tools' JSON
FALLBACK_PARSER = "hermes"  # the format required / named choices force when the server has no parser
RESERVED_KWARGS = frozenset({"messages", "tools", "documents", "add_generation_prompt", "tokenize", "tokenizer",
                             "continue_final_message", "return_dict", "return_assistant_tokens_mask",
                             "chat_template", "padding", "truncation", "max_length", "return_tensors"})


@dataclass(frozen=True)
class Function:
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool = False

    def as_tool(self) -> dict[str, Any]:
        """OpenAI's tool dict, as chat templates expect it."""
        fn: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            fn["description"] = self.description
        fn["parameters"] = self.parameters or {"type": "object", "properties": {}}
        return {"type": "function", "function": fn}  # (in the order OpenAI's clients send: templates dump it)


@dataclass(frozen=True)
class ToolPlan:
    tools: tuple[dict[str, Any], ...] = ()  # for the template
    parser: str | None = None  # parse the output's calls with this parser
    constraint: Constraint | None = None  # enforce the choice (required / named / strict under auto)
    choice: str = "none"


def plan(functions: list[Function] | None, choice: str | None, named: str | None, parallel: bool | None,
         server_parser: str | None, other_constraint: bool = False) -> ToolPlan:
    """``choice``: none | auto | required | function (then ``named`` is the function); None: the
    default (auto with tools, none without). ``server_parser``: ``--tool-call-parser`` resolved
    (None: the server has none). ``other_constraint``: the request has its own structured output."""
    functions = functions or []
    _require(len(functions) <= MAX_TOOLS, f"tools: at most {MAX_TOOLS} functions, got {len(functions)}")
    seen: set[str] = set()
    for i, f in enumerate(functions):
        _require(NAME.fullmatch(f.name) is not None,
                 f"tools[{i}].function.name {f.name[:80]!r} must be 1-64 letters, digits, '_', '.' or '-'")
        _require(f.name not in seen, f"tools[{i}].function.name {f.name!r} is given twice")
        seen.add(f.name)
        _require(f.parameters is None or isinstance(f.parameters, dict),
                 f"tools[{i}].function.parameters must be a JSON schema object")
    if functions:
        size = len(json.dumps([f.as_tool() for f in functions]))
        _require(size <= MAX_TOOLS_JSON, f"tools: {size} characters of JSON, more than {MAX_TOOLS_JSON}")
    if choice is None:
        choice = "auto" if functions else "none"
    _require(choice in ("none", "auto", "required", "function"),
             f"tool_choice must be none, auto, required or a named function, got {choice!r}")
    if choice in ("required", "function"):
        _require(bool(functions), f"tool_choice {'required' if choice == 'required' else 'naming a function'} "
                                  "needs tools")
    if choice == "function":
        _require(named in seen, f"tool_choice.function.name {named!r} is not one of the tools")
    if choice == "none" or not functions:
        return ToolPlan(choice=choice)
    schemas = [(f.name, f.parameters or {"type": "object"}) for f in functions]
    tools = tuple(f.as_tool() for f in functions)
    if choice == "auto":
        _require(server_parser is not None,
                 "tool_choice auto (the default with tools) needs a server started with --tool-call-parser "
                 "(this model's chat template names no format it could detect); tool_choice required or a "
                 "named function works without it")
        assert server_parser is not None
        strict = {f.name for f in functions if f.strict}
        constraint = grammar.strict_auto(server_parser, schemas, strict) if strict and not other_constraint else None
        return ToolPlan(tools, server_parser, constraint, choice)
    _require(not other_constraint, f"tool_choice {'required' if choice == 'required' else 'naming a function'} "
                                   "cannot be combined with response_format, regex, ebnf or choice")
    parser = server_parser or FALLBACK_PARSER
    if choice == "function":
        constraint = grammar.required(parser, [s for s in schemas if s[0] == named], parallel=False)
    else:
        constraint = grammar.required(parser, schemas, parallel=parallel is not False)
    return ToolPlan(tools, parser, constraint, choice)


def template_kwargs(kwargs: dict[str, Any] | None, name: str = "chat_template_kwargs") -> tuple[tuple[str, Any], ...]:
    """``chat_template_kwargs``: more variables for the template (not the ones Banyan sets itself)."""
    if not kwargs:
        return ()
    for k in kwargs:
        _require(k.isidentifier(), f"{name}: {k[:80]!r} is not a template variable name")
        _require(k not in RESERVED_KWARGS, f"{name}.{k} is set by the server, not the request")
    return tuple(sorted(kwargs.items()))


def history_calls(calls: list[tuple[str, str, str]], where: str) -> tuple[dict[str, Any], ...]:
    """An assistant turn's (id, name, arguments JSON) calls as templates read them: the arguments
    parsed (templates render them with ``tojson``)."""
    out = []
    for j, (cid, name, arguments) in enumerate(calls):
        try:
            args = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as e:
            raise InvalidArgument(f"{where}.tool_calls[{j}].function.arguments is not JSON: {e}") from None
        out.append({"id": cid, "type": "function", "function": {"name": name, "arguments": args}})
    return tuple(out)


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise InvalidArgument(msg)
