"""Structured output: xgrammar compilation off the loop, matchers per request branch, bitmasks.

Grammars compile in a thread pool; compiled grammars (and compile errors) are cached by
(kind, text), so a repeated schema costs nothing and a repeated bad one fails fast. The loop never
waits: a request whose grammar is compiling stays aside until ``poll`` says it is ready, failed or
past its deadline. Each step the scheduler fills one bitmask row per constrained sampling request;
the rows travel with the batch and the worker applies them to the logits before sampling.
"""

from __future__ import annotations

import json
import os
import re
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from shared.logging import get_logger
from shared.messages.common import Constraint
from shared.model_path import resolve_model

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


# Fill the masks of at least this many matchers in xgrammar's threads. It starts a new pool on
# every call and waits for its slowest thread: below this, one thread (~5 µs a row) takes under a
# millisecond and waits for no core the worker and the tokenizers keep busy.
PARALLEL_FILL_ROWS = 128
FORCED_CACHE = 4096  # jump-forward strings whose token ids are kept (a schema forces a few, often)


def fill_threads() -> int:
    """Threads for a parallel bitmask fill: half the CPUs this process may use (the worker and the
    tokenizers run beside it), at most 8 (one step's rows are too few to share further)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(8, cpus // 2))


def _bits_except(vocab_size: int, stop_ids: list[int]) -> np.ndarray:
    """A bitmask row with the bit of every token but ``stop_ids`` set (padding bits clear)."""
    bits = np.ones((vocab_size + 31) // 32 * 32, dtype=np.uint8)
    bits[vocab_size:] = 0
    bits[[t for t in stop_ids if 0 <= t < vocab_size]] = 0
    return np.packbits(bits, bitorder="little").view(np.int32)


def load_tokenizer(model_dir: str):
    """The HF tokenizer the grammar compiler is built from (xgrammar imported on the way: ~2 s of the two imports
    and the load, which the scheduler starts while the worker loads the model: ``early_tokenizer``)."""
    import xgrammar  # noqa: F401
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def early_tokenizer(model: str) -> Future:
    """``load_tokenizer`` of ``model`` (``--model``: resolved as the engine resolves it) in a thread of its own,
    started now (a failure shows when its result is taken)."""
    pool = ThreadPoolExecutor(1, thread_name_prefix="tokenizer")
    future = pool.submit(lambda: load_tokenizer(resolve_model(model)[0]))
    pool.shutdown(wait=False)
    return future


class GrammarBackend:
    def __init__(self, model_dir: str, vocab_size: int, stop_ids: list[int], threads: int = 2,
                 timeout_s: float = 30.0, tokenizer: Future | None = None) -> None:
        self.model_dir, self.vocab_size, self.stop_ids = model_dir, vocab_size, list(stop_ids)
        self._tokenizer = tokenizer  # (loading since the scheduler started, or None: loaded by the compiler's build)
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
        self._fillers = None  # xgrammar's (serial, threaded) bitmask fillers, made on first use
        words = (vocab_size + 31) // 32
        self._mask = np.empty((0, words), dtype=np.int32)  # reused each step (grown as needed)
        self._row = np.empty(words, dtype=np.int32)  # one matcher's mask (``only_stop_left``)
        self._not_stop = _bits_except(vocab_size, self.stop_ids)
        self._forced_ids: dict[str, list[int]] = {}  # jump-forward string → its token ids

    # ---- compilation -----------------------------------------------------------------------
    def _compiler(self):
        """Built once, in the pool (loads the tokenizer vocab)."""
        t0 = time.perf_counter()
        import xgrammar as xgr

        tok = None
        if self._tokenizer is not None:
            try:
                tok = self._tokenizer.result()
            except Exception:  # (loaded again below: the error, if it is one, is the compiler's)
                log.warning("early_tokenizer_failed", exc_info=True)
        tok = tok if tok is not None else load_tokenizer(self.model_dir)
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
            elif c.kind == "structural_tag":  # (tool_choice: services/tokenizer/tools/grammar.py)
                g = compiler.compile_structural_tag(c.value)
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
    def bitmask(self, matchers: list, rows: list[int] | None = None, n: int | None = None) -> np.ndarray:
        """(n, ceil(V / 32)) int32 allowed-token bits: row ``rows[k]`` from ``matchers[k]`` (default:
        row k), every other row allows every token. A view of a buffer the next call overwrites:
        copy it (``tobytes``) first. The buffer is numpy's, not torch's (``allocate_token_bitmask``):
        torch fills a large tensor in its intra-op threads, and on a host whose cores the worker and
        tokenizers keep busy that waits for descheduled threads (ms per step). xgrammar's fill
        holds the GIL: nothing else in the scheduler runs meanwhile."""
        n = len(matchers) if n is None else n
        if self._mask.shape[0] < n:
            self._mask = np.empty((max(n, 2 * self._mask.shape[0]), self._mask.shape[1]), dtype=np.int32)
        mask = self._mask[:n]
        if rows is None:
            rows = list(range(len(matchers)))
        elif len(rows) < n:
            mask.fill(-1)  # (the filled rows are overwritten whole)
        if len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(mask, rows[0])
        elif matchers:
            serial, threaded = self._filler()
            filler = threaded if len(matchers) >= PARALLEL_FILL_ROWS else serial
            filler.batch_fill_next_token_bitmask(matchers, mask, rows)
        return mask

    def _filler(self):
        if self._fillers is None:
            import xgrammar as xgr

            self._fillers = (xgr.BatchGrammarMatcher(1), xgr.BatchGrammarMatcher(fill_threads()))
        return self._fillers

    def jump_forward(self, matcher, budget: int) -> list[int]:
        """Tokens of the one continuation the grammar allows now (e.g. ``", "age": `` between two
        JSON values), already accepted by ``matcher``; [] when the next token is a real choice.
        The caller appends them without sampling: they are computed as a prefill chunk next step."""
        forced = matcher.find_jump_forward_string()
        if not forced or budget <= 0:
            return []
        ids = self._forced_ids.get(forced)
        if ids is None:
            if len(self._forced_ids) >= FORCED_CACHE:
                self._forced_ids.clear()
            ids = self._forced_ids[forced] = self.tokenizer.encode(forced, add_special_tokens=False)
        out: list[int] = []
        for t in ids[:budget]:
            if not matcher.accept_token(t):
                break
            out.append(t)
        return out

    def only_stop_left(self, matcher) -> bool:
        """The grammar is complete and cannot continue: only stop tokens are allowed next."""
        if not matcher.is_completed():
            return False
        matcher.fill_next_token_bitmask(self._row)
        return not np.bitwise_and(self._row, self._not_stop).any()

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
