"""The scheduler's answer to a load probe (``LoadReq`` → ``Load``: GetLoad, the tokenizers' routing)."""

from __future__ import annotations

from shared.messages.to_tokenizer import Load
from services.scheduler.counters import Counters
from services.scheduler.engine import EngineSession
from services.scheduler.requests import RequestTable


def num_waiting(table: RequestTable, e: EngineSession | None) -> int:
    """Requests not running yet: queued, or waiting for their grammar to compile."""
    return len(table.waiting) + (e.compiling if e is not None else 0)


def load_of(token: str, c: Counters, table: RequestTable, e: EngineSession | None) -> Load:
    pool = e.kv.pool_size if e is not None else 0
    free = e.kv.slots.num_free if e is not None else 0
    tiers: dict = {}
    if e is not None and e.hicache is not None:
        t = e.hicache.tree
        tiers = dict(host_pool_tokens=t.host.pool_size, host_used_tokens=t.host_used,
                     disk_capacity_bytes=t.disk_capacity, disk_used_bytes=t.disk_used)
    return Load(token=token, num_running=len(table.running), num_waiting=num_waiting(table, e), kv_free=free,
                kv_used=pool - free, kv_pool=pool, kv_evictable=e.kv.evictable if e is not None else 0,
                steps=c.steps, prefill_computed_tokens=c.prefill_computed, prefill_cached_tokens=c.prefill_cached,
                decode_tokens=c.decode, retractions=c.retractions, evicted_tokens=c.evicted_tokens,
                jump_forward_tokens=c.jump_forward_tokens, host_cached_tokens=c.host_hit_tokens,
                disk_cached_tokens=c.disk_hit_tokens, tier_stored_tokens=c.tier_tokens.get("device_to_host", 0),
                tier_loaded_tokens=c.tier_tokens.get("host_to_device", 0),
                disk_written_tokens=c.tier_tokens.get("host_to_disk", 0),
                disk_read_tokens=c.tier_tokens.get("disk_to_host", 0), tier_failures=sum(c.tier_failures.values()),
                **tiers)
