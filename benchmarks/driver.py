"""A stand-in scheduler for driving ``ModelRunner`` directly (GPU tests, benchmarks): it keeps the
rows, KV slots and token counts of its requests and turns each step's work into the
``ForwardBatch`` the real scheduler would send."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from shared.messages.common import SamplingParams, i32
from shared.messages.to_worker import ForwardBatch, NewReq


@dataclass
class _Req:
    row: int
    slots: list[int] = field(default_factory=list)  # KV slot of each position so far
    shared: int = 0  # leading slots that are another request's (a cached prefix): never freed by this one
    sent: bool = False  # the worker knows it (its NewReq went with a batch)


class Driver:
    def __init__(self, runner, max_rows: int = 256) -> None:
        runner.setup(max_rows)
        self.runner = runner
        self.free_rows = list(range(max_rows - 1, -1, -1))
        self.free_slots = list(range(runner.pool_size, 0, -1))  # slot 0 is padding
        self.reqs: dict[str, _Req] = {}
        self._released: list[int] = []
        self._step = 0

    def share(self, rid: str, source: str, n: int) -> None:
        """Admit ``rid`` with the first ``n`` KV slots of ``source`` as its cached prefix (as the
        scheduler does for a radix-cache hit); it is sent to the worker with its first step."""
        self.reqs[rid] = _Req(self.free_rows.pop(), list(self.reqs[source].slots[:n]), shared=n)

    def batch(self, work: list[tuple[str, list[int], bool]],
              params: SamplingParams = SamplingParams(temperature=0.0), follows: bool = False,
              cascade: tuple[list[int], list[int]] | None = None) -> ForwardBatch:
        """work: (request id, new token ids, sample after them) per request, in batch order; ids
        not seen before are admitted with ``params``. A token id -1 is the one the request's
        previous step sampled (overlap: still on the device). ``cascade``: shared-prefix groups
        (each request's group or -1, each group's prefix length), as the scheduler sends them."""
        new, rows, prefix, extend, sample, ids, slots = [], [], [], [], [], [], []
        for rid, tokens, do_sample in work:
            if rid not in self.reqs:
                self.reqs[rid] = _Req(self.free_rows.pop())
            r = self.reqs[rid]
            if not r.sent:
                r.sent = True
                new.append(NewReq(rid=rid, row=r.row, params=params, prefix_slots=i32(r.slots[:r.shared])))
            r = self.reqs[rid]
            rows.append(r.row)
            prefix.append(len(r.slots))
            extend.append(len(tokens))
            sample.append(int(do_sample))
            ids += tokens
            fresh = [self.free_slots.pop() for _ in tokens]
            r.slots += fresh
            slots += fresh
        self._step += 1
        released, self._released = self._released, []
        extra = dict(cascade_group=i32(cascade[0]), cascade_lens=i32(cascade[1])) if cascade else {}
        return ForwardBatch(step_id=self._step, new_reqs=new, released_rows=released, rows=i32(rows),
                            prefix_lens=i32(prefix), extend_lens=i32(extend), emits=i32(sample),
                            input_ids=i32(ids), out_slots=i32(slots), follows=follows, **extra)

    def run(self, work: list[tuple[str, list[int], bool]], **kw) -> np.ndarray:
        return self.runner.execute(self.batch(work, **kw))

    def run_overlapped(self, rids: list[str], steps: int) -> tuple[list[float], float]:
        """Decode ``steps`` steps of ``rids`` the way the worker serves the overlapping scheduler:
        step N+1 is launched (its inputs the tokens step N samples, resolved on the device)
        before step N's results are waited for. → (host seconds per step, device idle fraction)."""
        prev, marks, busy, idle = None, [], 0.0, 0.0
        for _ in range(steps):
            launched = self.runner.launch(self.batch([(rid, [-1], True) for rid in rids], follows=True))
            if prev is not None:
                self.runner.finish(prev)
                if marks:  # (the first step's gap is since whatever ran before)
                    busy, idle = busy + self.runner.busy_s, idle + self.runner.idle_s
                marks.append(time.perf_counter())
            prev = launched
        self.runner.finish(prev)
        return [b - a for a, b in zip(marks, marks[1:])], idle / max(busy + idle, 1e-12)

    def release(self, rid: str) -> None:
        r = self.reqs.pop(rid)
        self.free_slots += r.slots[r.shared:]
        self.free_rows.append(r.row)
        self._released.append(r.row)
