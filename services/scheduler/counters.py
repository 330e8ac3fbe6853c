"""Totals since the scheduler started. One object, owned by the scheduler: it outlives worker
restarts (the KV manager and batcher of a new worker add to the same totals), and GetLoad and the
metrics read it."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Counters:
    steps: int = 0  # step ids handed out: they go on across workers (a lost worker's late answer never matches)
    prompt: int = 0  # prompt tokens of the branches prefilled (prefill_cached of them came from the cache)
    prefill_computed: int = 0  # prompt (and resumed) tokens the model computes (counted when sent, as steps)
    prefill_cached: int = 0
    decode: int = 0
    retractions: int = 0
    evicted_tokens: int = 0
    jump_forward_tokens: int = 0  # output tokens appended by jump-forward (not sampled)
    cascade_steps: int = 0  # steps with shared-prefix attention groups
    cascade_saved: int = 0  # KV tokens those groups did not read
    preemptions: int = 0  # running requests retracted for a higher-priority one (priority scheduling)
    shed: int = 0  # waiting requests dropped from a full queue for a higher-priority one
    urgent_steps: int = 0  # steps that admitted a top-level request without the lower levels (batcher.py)
    # hierarchical cache (hicache.py): prompt tokens of admitted requests whose KV came back from the host
    # or disk tier (part of prefill_cached), and the copies that ended, by direction (device_to_host,
    # host_to_device, host_to_disk, disk_to_host): tokens moved and seconds spent; failures by kind
    demoted_tokens: int = 0  # pool evictions copied to the host on their way out (the next forward waits)
    cache_ops: int = 0  # tier copy ids handed out (like step ids, they go on across workers)
    host_hit_tokens: int = 0
    disk_hit_tokens: int = 0
    tier_tokens: dict[str, int] = field(default_factory=dict)
    tier_seconds: dict[str, float] = field(default_factory=dict)
    tier_failures: dict[str, int] = field(default_factory=dict)
