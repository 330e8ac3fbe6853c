"""The stand-ins ``bench_grammar_step`` runs the real ``Scheduler.loop`` against: per-section
timers, an instantaneous worker that samples a random allowed token per constrained row, a
tokenizer replica that keeps requests in flight, and the loop's poller."""

from __future__ import annotations

import gc
import hashlib
import time
from collections import defaultdict
from contextlib import contextmanager
from types import SimpleNamespace

import numpy as np

from shared.messages.codec import Codec
from shared.messages.common import from_i32, i32
from shared.messages.to_scheduler import StepOutput
from shared.messages.to_tokenizer import ToTokenizer
from shared.messages.to_worker import ForwardBatch, StepMask, ToWorker


class Sections:
    """Exclusive wall time per named section (a nested section's time is its own, not its
    parent's), accumulated per loop iteration."""

    def __init__(self) -> None:
        self.stack: list[list] = []
        self.cur: dict[str, float] = defaultdict(float)
        self.process_t0 = 0.0
        self._gc_t0 = 0.0
        gc.callbacks.append(self._gc)

    def _gc(self, phase: str, _info) -> None:
        """Cyclic GC pauses (inside whatever section ran): reported apart, as "gc"."""
        if phase == "start":
            self._gc_t0 = time.perf_counter()
        else:
            self.cur["gc"] += time.perf_counter() - self._gc_t0

    def close(self) -> None:
        gc.callbacks.remove(self._gc)

    def enter(self, name: str) -> None:
        now = time.perf_counter()
        if name == "process":
            self.process_t0 = now  # a step's output is being processed: the critical path starts
        self.stack.append([name, 0.0, now])

    def exit(self) -> None:
        name, child, t0 = self.stack.pop()
        dt = time.perf_counter() - t0
        self.cur[name] += dt - child
        if self.stack:
            self.stack[-1][1] += dt

    @contextmanager
    def __call__(self, name: str):
        self.enter(name)
        yield
        self.exit()

    def wrap(self, name, fn):
        """``name``: a section name, or a function of the enclosing section's name."""
        def timed(*a, **kw):
            self.enter(name(self.stack[-1][0] if self.stack else "") if callable(name) else name)
            try:
                return fn(*a, **kw)
            finally:
                self.exit()
        return timed


class FakeWorker:
    """Stands in for ``WorkerLink``: encodes what it is sent (as the real link does) and answers a
    step as soon as its bitmask is known, with a random allowed token per constrained row."""

    def __init__(self, s, sections: Sections, vocab: int, seed: int) -> None:
        self.s, self.sec, self.vocab = s, sections, vocab
        self.rng = np.random.default_rng(seed)
        self.codec = Codec(ToWorker)
        self.attached, self.losses = False, 0
        self.sock, self.monitor = object(), SimpleNamespace(sock=object())
        self.waiting: dict[int, ForwardBatch] = {}  # step → batch whose mask is deferred
        self.steps = 0
        self.stop_after = 0

    def send(self, msg) -> None:
        with self.sec("send_mask" if isinstance(msg, StepMask) else "send_batch"):
            self.codec.encode(msg)
        if isinstance(msg, StepMask):
            self.sec.cur["critical"] += time.perf_counter() - self.sec.process_t0
        with self.sec("fake"):
            if isinstance(msg, ForwardBatch):
                self.steps += 1
                if self.stop_after and self.steps >= self.stop_after:
                    self.s.stopping = True
                if msg.mask_deferred:
                    self.waiting[msg.step_id] = msg
                else:
                    self._answer(msg, msg.bitmask)
            elif isinstance(msg, StepMask):
                self._answer(self.waiting.pop(msg.step_id), msg.bitmask)

    def _answer(self, b: ForwardBatch, bitmask: bytes) -> None:
        sample = from_i32(b.emits).astype(bool)
        ids = np.where(sample, self.rng.integers(0, self.vocab, len(sample)), -1).astype(np.int32)
        rows = from_i32(b.mask_rows)
        if len(rows):
            mask = np.frombuffer(bitmask, dtype=np.int32).reshape(len(rows), -1)
            ids[rows] = [self._allowed(m) for m in mask]
        self.s.engine.answers[b.step_id] = StepOutput(step_id=b.step_id, next_ids=i32(ids))

    def _allowed(self, row: np.ndarray) -> int:
        """A uniformly random token among those ``row`` allows (rejection, then the exact set)."""
        cand = self.rng.integers(0, self.vocab, 64)
        hit = cand[(row[cand >> 5] >> (cand & 31)) & 1 == 1]
        if len(hit):
            return int(hit[0])
        bits = np.unpackbits(row.view(np.uint8), bitorder="little")[: self.vocab]
        return int(self.rng.choice(np.flatnonzero(bits)))

    def attach(self) -> None:
        self.attached = True

    def lost(self, *_) -> str:
        return ""

    def recv_nowait(self):
        return None


class FakeReplica:
    """Stands in for the tokenizer ROUTER: encodes what it is sent, hashes the token streams (the
    same seed must give the same streams before and after a change) and asks for a new request
    for every finished one."""

    def __init__(self, sections: Sections) -> None:
        self.sec, self.codec = sections, Codec(ToTokenizer)
        self.sock = object()
        self.digest = hashlib.sha256()
        self.tokens, self.refill = 0, 0
        self.streams: dict[str, list[int]] = defaultdict(list)
        self.done: list[tuple[list[int], str]] = []  # (token ids, finish reason) of finished requests

    def send(self, ident: bytes, msg) -> None:
        self.codec.encode(msg)
        for o in getattr(msg, "outs", ()):
            self.digest.update(f"{o.rid}:{o.token_ids}:{o.finish or ''};".encode())
            self.tokens += len(o.token_ids)
            self.streams[o.rid] += o.token_ids
            if o.finish:
                self.done.append((self.streams.pop(o.rid), o.finish))
                self.refill += 1

    def recv_nowait(self):
        return None


class FakePoller:
    """The loop's poll: new requests arrive here (replacing finished ones), nothing else."""

    def __init__(self, arrive) -> None:
        self.arrive = arrive

    def poll(self, _timeout_ms: int = 0) -> dict:
        self.arrive()
        return {}

    def register(self, *_) -> None:
        pass
