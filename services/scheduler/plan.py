"""The batch being built: requests in batch order, their token ranges, KV slots and which of them
sample — and the rewrites a step may need before it goes out (members-first order for shared-prefix
groups, forced output tokens as one-token rows)."""

from __future__ import annotations

import itertools

from services.scheduler.kv import KVManager, OutOfSlots
from services.scheduler.request import Req

# A jump-forward chunk (forced output tokens) is sent as one-token rows when the step then replays a
# decode graph: each row reads its whole context, so at most this many tokens a chunk and this many
# extra KV tokens read a step (~10 ns each on the H200: 2.6 ms at the cap, against the ~20 ms an
# eager step of an 8B model costs at batch 1 — W4's batch-1 JSON steps)
SPLIT_MAX_TOKENS = 32
SPLIT_MAX_EXTRA_KV = 262144
SPLIT_ROWS_NO_GRAPHS = 64  # a worker without graphs (CPU): split up to this many rows (the same steps as on a GPU)


class Plan:
    """The batch being built; slots are allocated as requests are added."""

    def __init__(self) -> None:
        self.reqs: list[Req] = []
        self.prefix: list[int] = []
        self.extend: list[int] = []
        self.emits: list[bool] = []
        self.ids: list[int] = []
        self.slots: list[int] = []
        self.prefill_tokens = 0
        self.prefilled: list[Req] = []
        self.queue_s: list[float] = []

    def add(self, r: Req, kv: KVManager, n: int) -> int:
        """Schedule up to ``n`` of ``r``'s uncomputed tokens (fewer if the pool is short)."""
        n = min(n, kv.available())
        while n > 0:
            try:
                new = kv.extend(r, n)
                break
            except OutOfSlots:
                n -= kv.page_size  # a partly filled page can make the estimate short
        if n <= 0:
            return 0
        start = r.num_computed - n
        self.reqs.append(r)
        self.prefix.append(start)
        self.extend.append(n)
        self.ids.extend(r.tokens(start, start + n))
        self.slots.extend(new)
        prefill = n > 1 or not (r.output or r.in_flight)  # (not the first decode, built before its token came)
        emits = r.num_computed == r.seq_len
        self.emits.append(emits)
        r.pending += emits  # its next token is unknown until this step's results arrive
        if prefill:
            self.prefill_tokens += n
            if start < len(r.prompt):  # prompt tokens others may want (in-batch dedup next step)
                self.prefilled.append(r)
        return n

    def add_decodes(self, reqs: list[Req], kv: KVManager) -> None:
        """``add(r, kv, 1)`` for each of ``reqs`` (running, one token to compute), their slots taken
        at once: the per-step host work at 1,024 decoding requests (W3) is the scheduler's turnaround."""
        new = kv.extend_each(reqs) if len(reqs) > 1 else None
        if new is None:
            for r in reqs:
                self.add(r, kv, 1)
            return
        self.reqs += reqs
        self.slots += new
        for r in reqs:
            start, p, out = len(r.slots) - 1, len(r.prompt), r.output
            self.prefix.append(start)
            self.extend.append(1)
            self.ids.append(r.prompt[start] if start < p else out[start - p] if start - p < len(out) else -1)
            emits = start + 1 == p + len(out) + r.pending - r.discard  # (num_computed == seq_len)
            self.emits.append(emits)
            r.pending += emits
            if not (out or r.pending - emits - r.discard):  # (``add``'s prefill rule for one token)
                self.prefill_tokens += 1
                if start < p:
                    self.prefilled.append(r)

    def reorder(self, order: list[int]) -> None:
        """The same requests in ``order`` (indices into the current one), their tokens with them."""
        ends = list(itertools.accumulate(self.extend))
        self.ids = [t for i in order for t in self.ids[ends[i] - self.extend[i]:ends[i]]]
        self.slots = [t for i in order for t in self.slots[ends[i] - self.extend[i]:ends[i]]]
        self.reqs, self.prefix, self.extend, self.emits = ([a[i] for i in order] for a in
                                                           (self.reqs, self.prefix, self.extend, self.emits))

    def split_output_chunks(self, max_rows: int) -> None:
        """When every multi-token chunk of the step is forced output (jump-forward) and small, send
        each of its tokens as a row of its own — the same request's table row at consecutive
        positions, only the last one sampling — so the step is a pure decode that replays a CUDA
        graph instead of running eagerly. Within a layer every row's KV is written before any row
        attends, so row j sees the chunk's tokens before it: the same attention as the chunk's."""
        chunks = [i for i, n in enumerate(self.extend) if n > 1]
        if not chunks or len(self.reqs) + sum(self.extend[i] - 1 for i in chunks) > max_rows:
            return
        extra = 0
        for i in chunks:
            n, start = self.extend[i], self.prefix[i]
            r = self.reqs[i]
            if start < len(r.prompt) or n > SPLIT_MAX_TOKENS or r.scoring:
                return  # a prompt chunk (the step runs eagerly anyway), or scored positions in it
            extra += (n - 1) * start + n * (n - 1) // 2
        if extra > SPLIT_MAX_EXTRA_KV:
            return
        reqs, prefix, extend, emits = [], [], [], []
        for r, start, n, e in zip(self.reqs, self.prefix, self.extend, self.emits, strict=True):
            reqs += [r] * n
            prefix += range(start, start + n)
            extend += [1] * n
            emits += [False] * (n - 1) + [e]
        self.reqs, self.prefix, self.extend, self.emits = reqs, prefix, extend, emits  # (ids, slots: unchanged)
