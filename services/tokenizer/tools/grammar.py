"""The grammar behind ``tool_choice``: an xgrammar structural tag (a ``structural_tag`` constraint,
compiled by the scheduler like any other) in the parser's own format.

- ``required`` / a named function: the output is one or more calls (one when parallel calls are
  off, or a function is named), each the format's markup around arguments that match the
  function's JSON schema; then only a stop token. Even a random model's output parses.
- ``auto`` with a ``strict`` function: free text until the format's trigger (``<tool_call>``, …);
  after it, a call whose arguments match the schema.
"""

from __future__ import annotations

import json
from typing import Any

from shared.errors import InvalidArgument
from shared.messages.common import Constraint
from services.tokenizer.tools import PARSERS
from services.tokenizer.tools.deepseek import CALLS_BEGIN, CALLS_END
from services.tokenizer.tools.mistral import BEGIN as MISTRAL_BEGIN

ANY_OBJECT: dict[str, Any] = {"type": "object"}
MAX_WHITESPACE = 1  # in a row, in the arguments: ``{"city": "Paris"}`` as models write it, no endless blank space
# pythonic arguments: Python keyword literals (the tools' schemas are not enforced in this format)
_PY_KWARGS = r"""
root ::= (kw ("," " " kw)*)?
kw ::= [a-zA-Z_] [a-zA-Z0-9_]* "=" value
value ::= string | number | "True" | "False" | "None" | list | dict
string ::= "\"" ([^"\\\n] | "\\" [\\"nt])* "\""
number ::= "-"? [0-9]+ ("." [0-9]+)?
list ::= "[" (value ("," " " value)*)? "]"
dict ::= "{" (string ":" " " value ("," " " string ":" " " value)*)? "}"
"""


def _tag(fmt, name: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "tag", "begin": fmt.call_begin(name), "end": fmt.call_end,
            "content": {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": MAX_WHITESPACE}}


def _calls(parser: str, functions: list[tuple[str, dict[str, Any]]], parallel: bool) -> dict[str, Any]:
    fmt = PARSERS[parser]
    if fmt.name == "pythonic":
        tags = [{"type": "tag", "begin": f"{name}(", "end": ")",
                 "content": {"type": "grammar", "grammar": _PY_KWARGS}} for name, _ in functions]
        calls = {"type": "tags_with_separator", "tags": tags, "separator": ", ", "at_least_one": True,
                 "stop_after_first": not parallel}
        return {"type": "sequence", "elements": [{"type": "const_string", "value": "["}, calls,
                                                 {"type": "const_string", "value": "]"}]}
    calls = {"type": "tags_with_separator", "tags": [_tag(fmt, n, s) for n, s in functions],
             "separator": fmt.separator, "at_least_one": True, "stop_after_first": not parallel}
    if fmt.name == "mistral":
        return {"type": "sequence", "elements": [{"type": "const_string", "value": MISTRAL_BEGIN + "["}, calls,
                                                 {"type": "const_string", "value": "]"}]}
    if fmt.name == "deepseek_v3":
        return {"type": "sequence", "elements": [{"type": "const_string", "value": CALLS_BEGIN}, calls,
                                                 {"type": "const_string", "value": CALLS_END}]}
    return calls


def _triggered(parser: str, functions: list[tuple[str, dict[str, Any]]]) -> dict[str, Any] | None:
    fmt = PARSERS[parser]
    if fmt.name == "pythonic":
        return None  # (no trigger: a pythonic output is calls or text from its first character)
    tags = []
    for name, schema in functions:
        tag = _tag(fmt, name, schema)
        if fmt.name == "mistral":
            tag["begin"], tag["end"] = f"{MISTRAL_BEGIN}[{tag['begin']}", tag["end"] + "]"
        elif fmt.name == "deepseek_v3":
            tag["begin"], tag["end"] = CALLS_BEGIN + tag["begin"], tag["end"] + CALLS_END
        tags.append(tag)
    return {"type": "triggered_tags", "triggers": [fmt.trigger], "tags": tags}


def structural_tag(fmt: dict[str, Any]) -> Constraint:
    return Constraint("structural_tag", value=json.dumps({"type": "structural_tag", "format": fmt},
                                                         ensure_ascii=False))


def required(parser: str, functions: list[tuple[str, dict[str, Any]]], parallel: bool) -> Constraint:
    """Calls only (at least one; one unless ``parallel``), of these (name, parameters schema) functions."""
    return structural_tag(_calls(parser, functions, parallel))


def strict_auto(parser: str, functions: list[tuple[str, dict[str, Any]]],
                strict: set[str]) -> Constraint | None:
    """Text or calls; a call's arguments follow the schema of a strict function (others: any object)."""
    fmt = _triggered(parser, [(n, s if n in strict else ANY_OBJECT) for n, s in functions])
    return None if fmt is None else structural_tag(fmt)


def external_structural_tag(text: str, name: str = "structural_tag") -> Constraint:
    """A structural tag a client sent (SMG's ``sampling_params.structural_tag``): xgrammar's format
    (``{"type": "structural_tag", "format": …}``) as it is, or SGLang's older one (``structures`` of
    begin / schema / end behind ``triggers``) in it."""
    try:
        tag = json.loads(text)
    except json.JSONDecodeError as e:
        raise InvalidArgument(f"{name} is not JSON: {e}") from None
    if isinstance(tag, dict) and "format" in tag:
        return Constraint("structural_tag", value=text)
    if not (isinstance(tag, dict) and isinstance(tag.get("structures"), list) and isinstance(tag.get("triggers"), list)):
        raise InvalidArgument(f"{name} must be a structural tag: {{\"type\": \"structural_tag\", \"format\": …}} or "
                              "SGLang's {\"structures\": [{begin, schema, end}], \"triggers\": […]}")
    tags = []
    for i, s in enumerate(tag["structures"]):
        if not (isinstance(s, dict) and isinstance(s.get("begin"), str) and isinstance(s.get("end"), str)):
            raise InvalidArgument(f"{name}.structures[{i}] needs string begin and end")
        tags.append({"type": "tag", "begin": s["begin"], "end": s["end"],
                     "content": {"type": "json_schema", "json_schema": s.get("schema", ANY_OBJECT),
                                 "max_whitespace_cnt": MAX_WHITESPACE}})
    return structural_tag({"type": "triggered_tags", "triggers": [str(t) for t in tag["triggers"]], "tags": tags})
