"""Structured output: xgrammar compilation off the loop, matchers per request branch, bitmasks.

Grammars compile in a thread pool; compiled grammars (and compile errors) are cached by
(kind, text), so a repeated schema costs nothing and a repeated bad one fails fast. The loop never
waits: a request whose grammar is compiling stays aside until ``poll`` says it is ready, failed or
past its deadline. Each step the scheduler fills one bitmask row per constrained sampling request;
the rows travel with the batch and the worker applies them to the logits before sampling.
"""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from shared.logging import get_logger
from shared.messages.common import Constraint

log = get_logger("scheduler")


class GrammarError(ValueError):
    """The constraint does not compile (the compiler's message is the text)."""


_SOURCE_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")  # xgrammar's "[12:59:39] /project/cpp/x.cc:43: "


def _compiler_message(e: Exception) -> str:
    return _SOURCE_PREFIX.sub("", str(e).strip())


def choice_regex(choices: list[str]) -> str:
    return "(" + "|".join(re.escape(c) for c in choices) + ")"


@dataclass
class Pending:
    """Branches of one request waiting for their grammar."""

    reqs: list
    key: tuple[str, str]
    future: Future


class GrammarBackend:
    def __init__(self, model_dir: str, vocab_size: int, stop_ids: list[int], threads: int = 2,
                 timeout_s: float = 30.0) -> None:
        self.model_dir, self.vocab_size, self.stop_ids = model_dir, vocab_size, list(stop_ids)
        self.timeout_s = timeout_s
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="grammar")
        # The compiler (tokenizer vocab → xgrammar) is built at start-up (``wait_ready``), before the
        # engine serves: the first constrained request does not pay for it, and its Python-heavy
        # build does not compete with the scheduling loop for the GIL while requests run.
        self._compiler_future: Future = self.pool.submit(self._compiler)
        self._cache: dict[tuple[str, str], Future] = {}
        self._started: dict[tuple[str, str], float] = {}  # when each compile began
        self.pending: list[Pending] = []
        self.compile_ms: list[float] = []  # recent compile times, for metrics
        self._batch = None  # xgrammar's multi-threaded bitmask filler, made on first use

    # ---- compilation -----------------------------------------------------------------------
    def _compiler(self):
        """Built once, in the pool (loads the tokenizer vocab)."""
        t0 = time.perf_counter()
        import xgrammar as xgr
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(self.model_dir)
        self.tokenizer = tok  # encodes jump-forward strings
        info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=self.vocab_size, stop_token_ids=self.stop_ids)
        compiler = xgr.GrammarCompiler(info, max_threads=2)
        log.info("grammar_compiler_ready", seconds=round(time.perf_counter() - t0, 3))
        return compiler

    def wait_ready(self) -> None:
        """Block until the compiler is built (seconds for a 128k vocabulary). A failure is logged
        here and reported to each constrained request."""
        try:
            self._compiler_future.result()
        except Exception:
            log.exception("grammar_compiler_failed")

    def _compile(self, key: tuple[str, str], c: Constraint):
        compiler = self._compiler_future.result()
        self._started[key] = time.monotonic()
        t0 = time.perf_counter()
        try:
            # compact JSON (no free whitespace between tokens): a model cannot wander off into
            # endless blank space, and outputs stay short
            if c.kind == "json_schema":
                g = compiler.compile_json_schema(c.value, any_whitespace=False)
            elif c.kind == "json_object":
                g = compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            elif c.kind == "regex":
                g = compiler.compile_regex(c.value)
            elif c.kind == "choice":
                g = compiler.compile_regex(choice_regex(c.choices))
            elif c.kind == "ebnf":
                g = compiler.compile_grammar(c.value)
            else:
                raise GrammarError(f"unknown constraint kind {c.kind!r}")
        except (RuntimeError, ValueError) as e:
            raise GrammarError(f"invalid {c.kind}: {_compiler_message(e)}") from None
        self.compile_ms.append((time.perf_counter() - t0) * 1e3)
        return g

    def submit(self, reqs: list, c: Constraint) -> None:
        key = (c.kind, c.value if c.kind != "choice" else json.dumps(c.choices))  # (["a", "b"] vs ["a\x00b"])
        fut = self._cache.get(key)
        if fut is None:
            fut = self._cache[key] = self.pool.submit(self._compile, key, c)
        self.pending.append(Pending(reqs, key, fut))

    def poll(self) -> tuple[list[list], list[tuple[list, str]]]:
        """(branch lists now ready with matchers attached, (branch list, error) pairs)."""
        ready, failed, still = [], [], []
        now = time.monotonic()
        for p in self.pending:
            if p.future.done():
                try:
                    compiled = p.future.result()
                except GrammarError as e:
                    failed.append((p.reqs, str(e)))
                    continue
                for r in p.reqs:
                    r.matcher = self._matcher(compiled)
                ready.append(p.reqs)
            elif now - self._started.get(p.key, now) > self.timeout_s:
                failed.append((p.reqs, f"grammar compilation took longer than {self.timeout_s:.0f} s"))
            else:
                still.append(p)
        self.pending = still
        return ready, failed

    def _matcher(self, compiled):
        import xgrammar as xgr

        return xgr.GrammarMatcher(compiled, override_stop_tokens=self.stop_ids or None)

    # ---- per step --------------------------------------------------------------------------
    def bitmask(self, matchers: list) -> np.ndarray:
        """One int32 row of allowed-token bits per matcher: (N, ceil(V / 32)), filled by xgrammar's
        own threads (one row per matcher, in parallel, outside the GIL)."""
        import xgrammar as xgr

        mask = xgr.allocate_token_bitmask(len(matchers), self.vocab_size)
        if len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(mask, 0)
        else:
            if self._batch is None:
                self._batch = xgr.BatchGrammarMatcher()
            self._batch.batch_fill_next_token_bitmask(matchers, mask)
        return mask.numpy()

    def jump_forward(self, matcher, budget: int) -> list[int]:
        """Tokens of the one continuation the grammar allows now (e.g. ``", "age": `` between two
        JSON values), already accepted by ``matcher``; [] when the next token is a real choice.
        The caller appends them without sampling: they are computed as a prefill chunk next step."""
        forced = matcher.find_jump_forward_string()
        if not forced or budget <= 0:
            return []
        out: list[int] = []
        for t in self.tokenizer.encode(forced, add_special_tokens=False)[:budget]:
            if not matcher.accept_token(t):
                break
            out.append(t)
        return out

    def only_stop_left(self, matcher) -> bool:
        """The grammar is complete and cannot continue: only stop tokens are allowed next."""
        if not matcher.is_completed():
            return False
        bits = np.unpackbits(self.bitmask([matcher])[0].view(np.uint8), bitorder="little")[: self.vocab_size]
        allowed = np.flatnonzero(bits)
        return set(allowed.tolist()) <= set(self.stop_ids)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
