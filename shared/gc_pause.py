"""Python's cyclic collector in a serving process: the start-up heap frozen out of its sight, full
collections paced by the busy loop, and every pause measured.

A full (generation 2) collection walks every tracked container and every reference in it, with the
GIL held. After ``import torch, transformers`` that is ~400k objects (~100–190 ms); in the scheduler
under load it is also every running request's token and slot lists (1,024 requests × ~2,400 ids).
Python's count thresholds run one every few dozen steps under load (they count what a step
allocates): the worker stops launching kernels, the scheduler stops building steps. Measured on the
H200 (W3, 1,024 running requests, ``benchmarks/gpu/step_trace.py``): a 70–150 ms stall before every
~17th decode step — the scheduler's full collections, 16 in one W3 run taking 1.8 s, 7.9 % GPU idle.
``freeze_heap()`` once start-up is done moves what start-up made into the permanent generation (it
lives as long as the process anyway); ``FullCollections`` runs the scheduler's full collections when
it is idle and at most every ``--gc-full-interval`` seconds when busy (one in that W3 run: 1.1 % idle);
``GcPauses`` reports every collection by generation (``banyan:gc_pause_seconds``) and
``banyan:gc_frozen_objects`` what start-up froze, so a regression shows in the metrics."""

from __future__ import annotations

import asyncio
import bisect
import gc
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily

PAUSE_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class FullCollections:
    """When a busy loop's full collections happen: never on Python's count thresholds (they fire every
    few dozen steps under load, each walking the live heap: the scheduler's token and slot lists of
    1,024 running requests, ~110 ms on the H200 host), but when the loop is idle (``idle()``: the heap
    is small then; at most every ``interval`` ÷ 10, as a request that arrives meanwhile waits for it)
    and, under load that never idles, once every ``interval`` seconds (``busy()``). The young
    generations keep their automatic collections (they walk only young objects). Cyclic garbage waits
    at most ``interval``; the scheduler makes little (its objects go by reference counting).
    ``interval`` 0: Python's own thresholds."""

    def __init__(self, interval: float, clock=time.monotonic) -> None:
        self.interval, self.clock = interval, clock
        self.last = clock()
        if interval > 0:
            t0, t1, _ = gc.get_threshold()
            gc.set_threshold(t0, t1, 1 << 30)  # (gen-2 count: young collections between full ones)

    def idle(self) -> None:
        if self.interval > 0 and gc.get_count()[2] > 0 and self.clock() - self.last >= self.interval / 10:
            self._collect()  # (get_count()[2]: young collections since the last full one)

    def busy(self) -> None:
        if self.interval > 0 and self.clock() - self.last >= self.interval:
            self._collect()

    def _collect(self) -> None:
        gc.collect()
        self.last = self.clock()


async def pace(pacer: FullCollections, busy: Callable[[], bool], flush: Callable[[], None],
               every: float = 1.0) -> None:
    """An asyncio loop's pacer (the tokenizer's): every ``every`` seconds ``flush()`` (``GcPauses.mirror``),
    then the pacer's ``busy()`` or ``idle()``."""
    while True:
        await asyncio.sleep(every)
        flush()
        if busy():
            pacer.busy()
        else:
            pacer.idle()


def freeze_heap() -> None:
    """Collect what start-up left as garbage, then freeze the rest (call once the process is set up,
    before it serves; calling it again freezes what was made since)."""
    gc.collect()
    gc.freeze()


class GcPauses:
    """This process's collections as ``banyan:gc_pause_seconds{generation}``, a histogram rendered
    from plain counters when ``registry`` is collected. One ``gc.callbacks`` entry for the process (a
    start and a stop call per collection, ~1 µs) counts; it takes no lock — a prometheus_client
    metric observed from inside a collection could wait on a lock its own thread holds."""

    _t0 = 0.0
    counts: list[list[int]] = [[0] * (len(PAUSE_BUCKETS) + 1) for _ in range(3)]  # per generation, per bucket
    sums = [0.0, 0.0, 0.0]
    pending: list[tuple[int, float]] | None = None  # (generation, seconds) for ``mirror`` (None: not kept)

    @staticmethod
    def mirror(histogram) -> Callable[[], None]:
        """For a registry a custom collector cannot join (prometheus_client's multiprocess mode): the
        pauses are kept (up to 10,000 between calls) and the returned ``flush()`` observes them into
        ``histogram`` (labelled by generation) — call it from the process's own loop, never from a
        collection."""
        GcPauses.pending = []
        if _callback not in gc.callbacks:
            gc.callbacks.append(_callback)

        def flush() -> None:
            batch, GcPauses.pending = GcPauses.pending or [], []
            for gen, seconds in batch:
                histogram.labels(str(gen)).observe(seconds)

        return flush

    def __init__(self, registry: CollectorRegistry) -> None:
        if _callback not in gc.callbacks:
            gc.callbacks.append(_callback)
        registry.register(self)

    def collect(self):
        h = HistogramMetricFamily("banyan:gc_pause_seconds", "Python cyclic-GC pauses of this process, by "
                                  "generation (the GIL is held: nothing else in the process runs)",
                                  labels=["generation"])
        for gen in range(3):
            cum, buckets = 0, []
            for bound, n in zip((*map(str, PAUSE_BUCKETS), "+Inf"), self.counts[gen]):
                cum += n
                buckets.append((bound, cum))
            h.add_metric([str(gen)], buckets, self.sums[gen])
        yield h
        yield GaugeMetricFamily("banyan:gc_frozen_objects", "Objects frozen out of the collector's walk at start-up "
                                "(gc.freeze: the start-up heap)", value=gc.get_freeze_count())


def _callback(phase: str, info: dict) -> None:
    if phase == "start":
        GcPauses._t0 = time.perf_counter()
    elif GcPauses._t0:
        seconds, gen = time.perf_counter() - GcPauses._t0, min(info.get("generation", 2), 2)
        GcPauses._t0 = 0.0
        GcPauses.counts[gen][bisect.bisect_left(PAUSE_BUCKETS, seconds)] += 1
        GcPauses.sums[gen] += seconds
        if GcPauses.pending is not None and len(GcPauses.pending) < 10_000:
            GcPauses.pending.append((gen, seconds))
