"""shared/gc_pause.py: the collector's pauses counted by generation, the start-up heap frozen."""

from __future__ import annotations

import gc

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from shared.gc_pause import PAUSE_BUCKETS, GcPauses, freeze_heap


def samples(registry: CollectorRegistry) -> dict[tuple[str, str, str], float]:
    out = {}
    for fam in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in fam.samples:
            out[(s.name, s.labels.get("generation", ""), s.labels.get("le", ""))] = s.value
    return out


def test_collections_counted_by_generation():
    reg = CollectorRegistry()
    GcPauses(reg)
    GcPauses(CollectorRegistry())  # a second registry in the same process: one callback still
    before = samples(reg)
    gc.collect(2)
    gc.collect(2)
    gc.collect(1)
    after = samples(reg)

    def delta(name, gen, le=""):
        return after[(name, gen, le)] - before.get((name, gen, le), 0.0)

    assert delta("banyan:gc_pause_seconds_count", "2") == 2
    assert delta("banyan:gc_pause_seconds_count", "1") >= 1
    assert delta("banyan:gc_pause_seconds_sum", "2") > 0
    # cumulative buckets ending in +Inf = count
    gen2 = [after[("banyan:gc_pause_seconds_bucket", "2", str(b))] for b in PAUSE_BUCKETS]
    assert gen2 == sorted(gen2)
    assert after[("banyan:gc_pause_seconds_bucket", "2", "+Inf")] == after[("banyan:gc_pause_seconds_count", "2", "")]


def test_freeze_heap_takes_the_start_up_heap_out_of_the_walk():
    gc.unfreeze()
    try:
        keep = [[i] for i in range(20_000)]  # start-up objects that live on
        freeze_heap()
        frozen = gc.get_freeze_count()
        assert frozen >= len(keep)
        reg = CollectorRegistry()
        GcPauses(reg)
        assert samples(reg)[("banyan:gc_frozen_objects", "", "")] == frozen
        # a full collection now walks what was made since, not the frozen heap
        assert len(gc.get_objects(generation=2)) < frozen
    finally:
        gc.unfreeze()
