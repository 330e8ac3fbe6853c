"""What a program can add to its state: text, generation, selection, and chat roles."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Union


@dataclass(frozen=True)
class Gen:
    """Generate text and store it under ``name``. Constraints: one of regex / json_schema / choices."""

    name: str | None = None
    max_tokens: int | None = 128
    stop: list[str] | str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    regex: str | None = None
    json_schema: str | None = None
    ignore_eos: bool = False


@dataclass(frozen=True)
class Select:
    """Pick the choice the model scores highest after the current prefix."""

    name: str | None
    choices: list[str]
    method: str = "mean"  # "mean": token-length normalised log-probability; "sum": total


@dataclass(frozen=True)
class Role:
    """A chat turn: its parts are strings, Gen or Select (inside the turn)."""

    role: str
    parts: list[Any] = field(default_factory=list)


Expr = Union[str, Gen, Select, Role]


def gen(name: str | None = None, max_tokens: int | None = 128, stop=None, temperature: float | None = None,
        top_p: float | None = None, top_k: int | None = None, seed: int | None = None, regex: str | None = None,
        json_schema: str | dict | None = None, ignore_eos: bool = False) -> Gen:
    if isinstance(json_schema, dict):
        import json

        json_schema = json.dumps(json_schema)
    return Gen(name, max_tokens, stop, temperature, top_p, top_k, seed, regex, json_schema, ignore_eos)


def select(name: str | None = None, choices: list[str] | None = None, method: str = "mean") -> Select:
    if not choices:
        raise ValueError("select needs at least one choice")
    if method not in ("mean", "sum"):
        raise ValueError("select method must be 'mean' (length-normalised) or 'sum'")
    return Select(name, list(choices), method)


def _role(role: str):
    def make(*parts: Any) -> Role:
        return Role(role, list(parts))

    make.__name__ = role
    make.__doc__ = f"A {role} turn: ``s += {role}('text', gen('x'))``."
    return make


system = _role("system")
user = _role("user")
assistant = _role("assistant")
