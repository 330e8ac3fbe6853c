"""Program state: the conversation or text so far, the named values, and how each expression
is executed against the backend."""

from __future__ import annotations

import copy
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from shared.proto.banyan.v1 import generation_pb2 as pb
from banyan.lang.backend import Backend, GenResult
from banyan.lang.ir import Gen, Role, Select


class ProgramState:
    """``s`` in a program. Plain programs accumulate text; chat programs accumulate turns (roles)
    rendered with the model's chat template. ``s[name]`` reads what gen/select stored."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self._text = ""
        self._turns: list[tuple[str, str]] = []  # finished chat turns
        self._open: tuple[str, str] | None = None  # the turn being written
        self.values: dict[str, Any] = {}
        self.results: dict[str, GenResult] = {}  # usage of each gen, by name
        self.scores: dict[str, pb.ScoreResponse] = {}  # the server's scores of each select, by name

    # ---- user API --------------------------------------------------------------------------
    def __iadd__(self, expr: Any) -> ProgramState:
        self._add(expr)
        return self

    def __getitem__(self, name: str) -> Any:
        return self.values[name]

    def text(self) -> str:
        if not self._turns and self._open is None:
            return self._text
        return "".join(f"[{r}] {c}\n" for r, c in self.messages())

    def messages(self) -> list[tuple[str, str]]:
        return self._turns + ([self._open] if self._open else [])

    def fork(self, k: int) -> ForkGroup:
        """``k`` copies that continue independently (their shared prefix is cached server-side)."""
        if k < 1:
            raise ValueError(f"fork needs k >= 1, got {k}")
        return ForkGroup([self._copy() for _ in range(k)])

    # ---- execution -------------------------------------------------------------------------
    def _copy(self) -> ProgramState:
        c = copy.copy(self)
        c._turns, c.values, c.results, c.scores = list(self._turns), dict(self.values), dict(self.results), dict(self.scores)
        return c

    def _add(self, expr: Any) -> None:
        if isinstance(expr, str):
            self._append(expr)
        elif isinstance(expr, Role):
            if self._open is not None:
                raise ValueError(f"roles do not nest: {expr.role}(...) inside {self._open[0]}(...)")
            if self._text:
                raise ValueError("this program started as plain text: a state is either plain text or chat turns")
            self._open = (expr.role, "")
            try:
                for part in expr.parts:
                    self._add(part)
                self._turns.append(self._open)
            finally:  # a failed part drops the unfinished turn: the state stays usable
                self._open = None
        elif isinstance(expr, Gen):
            self._gen(expr)
        elif isinstance(expr, Select):
            self._select(expr)
        else:
            raise TypeError(f"cannot add {type(expr).__name__} to a program state")

    def _append(self, text: str) -> None:
        if self._open is not None:
            self._open = (self._open[0], self._open[1] + text)
        elif self._turns:
            raise ValueError("in a chat program, text goes inside a role: s += user('...')")
        else:
            self._text += text

    def _prompt_ids(self) -> list[int]:
        if self._open is None and not self._turns:
            return self.backend.text_ids(self._text, add_special_tokens=True)
        if self._open is None:
            raise ValueError("in a chat program, gen/select go inside an assistant turn: s += assistant(gen(...))")
        role, partial = self._open
        if role != "assistant":
            raise ValueError("gen/select inside a chat program belong in an assistant turn")
        ids = self.backend.chat_ids(self._turns, add_generation_prompt=True)
        return ids + (self.backend.text_ids(partial, add_special_tokens=False) if partial else [])

    @staticmethod
    def _gen_params(g: Gen) -> tuple[pb.SamplingParams, dict[str, str]]:
        """The sampling parameters and the constraint (as GenerateRequest fields) of a gen."""
        sp = pb.SamplingParams(ignore_eos=g.ignore_eos)
        for key in ("max_tokens", "temperature", "top_p", "top_k", "seed"):
            if getattr(g, key) is not None:
                setattr(sp, key, getattr(g, key))
        if g.stop:
            sp.stop.extend([g.stop] if isinstance(g.stop, str) else g.stop)
        return sp, {k: v for k, v in (("regex", g.regex), ("json_schema", g.json_schema)) if v}

    def _gen(self, g: Gen) -> None:
        sp, constraint = self._gen_params(g)
        res = self.backend.generate(self._prompt_ids(), sp, **constraint)
        self._store(g, res)
        self._append(res.text)

    def _store(self, g: Gen, res: GenResult) -> None:
        if g.name:
            self.values[g.name] = res.text
            self.results[g.name] = res

    def _select(self, s: Select) -> None:
        resp = self.backend.score(self._prompt_ids(), s.choices)
        values = [x.logprob_mean if s.method == "mean" else x.logprob_sum for x in resp.scores]
        best = max(range(len(values)), key=values.__getitem__)  # ties: the first choice
        if s.name:
            self.values[s.name] = s.choices[best]
            self.values[f"{s.name}_scores"] = values
            self.scores[s.name] = resp
        self._append(s.choices[best])


class ForkGroup:
    """The branches of ``s.fork(k)``; ``forks += expr`` runs the expression on every branch at once."""

    def __init__(self, states: list[ProgramState]) -> None:
        self.states = states

    def __iadd__(self, expr: Any) -> ForkGroup:
        self.each(lambda i, st: st._add(expr))
        return self

    def each(self, fn) -> None:
        """Run ``fn(index, state)`` on every branch concurrently."""
        with ThreadPoolExecutor(len(self.states)) as pool:
            list(pool.map(lambda p: fn(*p), enumerate(self.states)))

    def join(self) -> list[ProgramState]:
        """The branches, finished (every ``+=`` on a group or a branch runs to completion before it
        returns, so there is nothing to wait for); read their values with ``branch["name"]``."""
        return list(self.states)

    def __getitem__(self, i: int) -> ProgramState:
        return self.states[i]

    def __iter__(self):
        return iter(self.states)

    def __len__(self) -> int:
        return len(self.states)
