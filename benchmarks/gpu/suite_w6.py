"""W6 (the hierarchical KV cache) of the GPU suite, and W2H (W2 with the host tier on).

W6: ``w6_conversations`` conversations of ``w6_turns`` turns on one ``w6_system``-token system
prompt, each turn a ``w6_user``-token message and a ``w6_output``-token answer, sent by
``w6_concurrency`` users in a closed loop (``banyan bench --dataset multiturn``), on servers whose
GPU KV pool is capped at ``w6_pool`` tokens so the conversations' history does not fit in it:

  off   the GPU tier alone (evicted history is recomputed)
  host  + a host tier of ``w6_host_gib`` GiB (write-through)
  disk  + a disk tier of ``w6_disk_gib`` GiB: a first pass, the server stopped and started again on
        the same directory, the same conversations again with pass 1's very prompts (the host tier
        starts empty: what is cached came from the disk, directly or through the host). Judged by
        ``disk_supplied`` = 1 − pass 2's computed prompt tokens ÷ cold pass 1's: the share of the work a
        cold server does that the disk took over (the plain hit rate would count the reuse within a
        pass, which a cold server gets too)

Each pass reports output tok/s, TTFT by turn (and over turns 2+), the hit rate vs the optimum, and
the engine's counters (GetLoad deltas: tokens computed, cached, from the host / disk tier).
W2H: the W2 requests on a server with the host tier (default pool): its output tok/s vs W2's.
W2S: the W2 requests on a server without the SMG gRPC service (``--disable-smg-grpc``): W2's default
server runs it with no subscriber, so W2 ÷ W2S is what the unused service costs.
"""

from __future__ import annotations

import asyncio
import shutil

from banyan.bench import datasets
from banyan.bench.backends import GrpcBackend
from banyan.bench.multiturn import run_multiturn
from benchmarks.gpu import suite_counters
from benchmarks.gpu import suite_workloads as wl

COUNTERS = ("prefill_computed_tokens", "prefill_cached_tokens", "host_cached_tokens", "disk_cached_tokens",
            "tier_stored_tokens", "tier_loaded_tokens", "disk_written_tokens", "disk_read_tokens", "tier_failures",
            "evicted_tokens", "retractions")


def conversations(s: wl.Sizes, vocab: int) -> list[datasets.Conversation]:
    return datasets.multiturn_conversations(s.w6_conversations, s.w6_turns, s.w6_system, (s.w6_user, s.w6_user),
                                            (s.w6_output, s.w6_output), vocab, wl.SEED_W6)


def one_pass(target: str, s: wl.Sizes, vocab: int, record: dict | None = None, replay: dict | None = None) -> dict:
    before = wl.get_load(target)

    async def go() -> dict:
        backend = GrpcBackend(target)
        try:
            return await run_multiturn(backend, conversations(s, vocab), s.w6_concurrency, progress=False,
                                       record=record, replay=replay)
        finally:
            await backend.close()

    summary = asyncio.run(go())
    after = wl.get_load(target)
    load = {k: getattr(after, k) - getattr(before, k) for k in COUNTERS}
    prompt = load["prefill_computed_tokens"] + load["prefill_cached_tokens"]
    return {**wl.brief(summary), "load": load,
            "engine_hit_rate": load["prefill_cached_tokens"] / prompt if prompt else 0.0,
            "host_fraction": load["host_cached_tokens"] / prompt if prompt else 0.0,
            "disk_fraction": load["disk_cached_tokens"] / prompt if prompt else 0.0,
            "hit_vs_optimum": summary["cache_hit_rate"] / summary["optimum_hit_rate"]
            if summary["optimum_hit_rate"] else 0.0}


def w6(suite) -> dict:
    s, vocab, out = suite.sizes, suite.facts["vocab"], {}
    pool = ("--max-total-tokens", str(s.w6_pool))
    host = (*pool, "--hicache-size", str(s.w6_host_gib))
    for variant in s.w6_variants:
        if variant in ("off", "host"):
            server = suite.server(f"w6_{variant}", *(pool if variant == "off" else host))
            try:
                out[variant] = one_pass(server.target, s, vocab)
            finally:
                server.stop()
            suite.doc["results"]["W6"] = out  # (kept if a timeout cuts the later variants)
            suite.save()
            continue
        store = suite.args.out / "w6_kv_store"
        shutil.rmtree(store, ignore_errors=True)
        flags = (*host, "--hicache-storage-dir", str(store), "--hicache-storage-size", str(s.w6_disk_gib),
                 "--grace-seconds", "60")  # (the writes queued at the stop get time to finish)
        sent: dict = {}  # pass 2 sends pass 1's very prompts (greedy answers may differ between runs)
        for i in (1, 2):
            server = suite.server(f"w6_disk{i}", *flags)
            try:
                out[f"disk_pass{i}"] = one_pass(server.target, s, vocab, record=sent if i == 1 else None,
                                                replay=sent if i == 2 else None)
            finally:
                server.stop(timeout=120)
            suite.doc["results"]["W6"] = out
            suite.save()
        p1, p2 = out.get("disk_pass1"), out.get("disk_pass2")
        if p1 and p2 and "load" in p1 and "load" in p2:
            # After the restart nothing is in memory: what pass 2 does not compute of what the cold pass 1
            # had to compute came from the disk tier (directly, or loaded once and reused from there).
            c1, c2 = p1["load"]["prefill_computed_tokens"], p2["load"]["prefill_computed_tokens"]
            out["disk_supplied"] = 1 - c2 / c1 if c1 else 0.0
    off, on = out.get("off"), out.get("host")
    if off and on:
        out["host_vs_off"] = {
            "output_throughput": on["output_throughput"] / off["output_throughput"],
            "ttft_p50_later_turns": on["ttft_later_turns_ms"]["p50"] / off["ttft_later_turns_ms"]["p50"]}
    return out


def w2h(suite) -> dict:
    """W2 (no reuse) with the host tier on: the tier must cost nothing here. With its steps by kind
    (as W2's) and the tier's traffic: tokens backed up / demoted (the copies a forward waits for)."""
    server = suite.server("w2h", "--hicache-size", str(suite.sizes.w6_host_gib))
    try:
        before, tier0 = suite.counters(server), suite_counters.tier_counters(server)
        res = wl.w2(server.target, suite.sizes, suite.facts["vocab"])
        after, tier1 = suite.counters(server), suite_counters.tier_counters(server)
        if before is not None and after is not None:
            suite.doc["gpu_idle"]["W2H"] = suite_counters.worker_delta(res, "W2H", before, after)
        if isinstance(res, dict) and tier0 is not None and tier1 is not None:
            res["tier"] = {k: tier1[k] - tier0.get(k, 0.0) for k in tier1}
        return res
    finally:
        server.stop()


def w2s(suite) -> dict:
    """W2 without the SMG gRPC service: the baseline of what the service costs when nobody uses it."""
    server = suite.server("w2s", "--disable-smg-grpc")
    try:
        return wl.w2(server.target, suite.sizes, suite.facts["vocab"])
    finally:
        server.stop()


def run(suite) -> None:
    """The suite's W6, W2H and W2S phases, when named in --workloads."""
    for name, fn in (("W2H", w2h), ("W2S", w2s), ("W6", w6)):  # (the short ones first: a timeout cuts W6)
        if name in suite.workloads:
            suite.phase(name, lambda fn=fn: fn(suite), store=name)
