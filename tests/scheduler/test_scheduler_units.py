"""Scheduler pieces without processes: policies, chunked prefill, in-batch dedup, retraction."""

from __future__ import annotations

from collections import deque

from services.scheduler.batcher import Batcher, Limits
from services.scheduler.kv import KVManager
from services.scheduler.policy import POLICIES
from services.scheduler.request import Req, Status
from shared.messages.common import SamplingParams, from_i32


def req(prompt, max_new=8, rid="r", index=0) -> Req:
    return Req(rid=rid, replica=b"t", prompt=list(prompt), params=SamplingParams(max_new_tokens=max_new), index=index)


def batcher(pool=4096, policy="fcfs", max_prefill=1024, chunk=1024, rows=64, page=1) -> Batcher:
    return Batcher(KVManager(pool, rows, page), POLICIES[policy](), Limits(rows, max_prefill, chunk))


def step(b: Batcher, running, waiting, next_token=5):
    """Build one batch and apply a fake worker result the way the scheduler does."""
    s = b.build(running, waiting)
    if s is None:
        return None
    apply(b, s, running, next_token)
    return s


def apply(b: Batcher, s, running, next_token=5):
    for r, n, sample in zip(s.reqs, s.extend, s.emits):
        if n > 1 or not r.output:
            b.kv.cache_prefix(r)
        if sample:
            r.pending -= 1
            r.output.append(next_token)
    b.kv.check_integrity(running)


def finish_all(b: Batcher, running):
    for r in list(running):
        running.remove(r)
        b.kv.release(r)
        r.status = Status.FINISHED
    b.kv.check_integrity(running)


def test_chunked_prefill_spans_steps_and_then_decodes():
    b = batcher(max_prefill=100, chunk=64)
    running, waiting = [], deque([req(range(10, 160))])
    s = step(b, running, waiting)
    assert from_i32(s.msg.extend_lens).tolist() == [64] and s.emits == [False]
    s = step(b, running, waiting)
    assert from_i32(s.msg.prefix_lens).tolist() == [64] and from_i32(s.msg.extend_lens).tolist() == [64]
    s = step(b, running, waiting)
    assert from_i32(s.msg.extend_lens).tolist() == [22] and s.emits == [True]
    s = step(b, running, waiting)
    assert from_i32(s.msg.extend_lens).tolist() == [1] and from_i32(s.msg.input_ids).tolist() == [5]
    finish_all(b, running)


def test_in_batch_dedup_defers_a_request_sharing_an_uncached_prefix():
    b = batcher()
    shared = list(range(100, 300))
    running, waiting = [], deque([req(shared + [1], rid="a"), req(shared + [2], rid="b")])
    s = step(b, running, waiting)
    assert [r.rid for r in s.reqs] == ["a"] and [r.rid for r in waiting] == ["b"]
    s = step(b, running, waiting)
    new = {r.rid: n for r, n in zip(s.reqs, s.extend)}
    assert new == {"a": 1, "b": 1}  # b found the shared 200 tokens in the cache, computes its last token
    assert running[1].cached_tokens == 200
    finish_all(b, running)


def test_lpm_prefers_the_longest_cached_prefix():
    b = batcher(policy="lpm")
    running, waiting = [], deque([req(list(range(500, 600)) + [1], rid="warm")])
    step(b, running, waiting)
    finish_all(b, running)
    waiting = deque([req(list(range(700, 800)), rid="cold"), req(list(range(500, 600)) + [9], rid="hit")])
    assert [r.rid for r in b.policy.order(waiting, b.kv)] == ["hit", "cold"]
    assert [r.rid for r in POLICIES["fcfs"]().order(waiting, b.kv)] == ["cold", "hit"]


def test_dfs_weight_groups_requests_of_the_heavier_subtree_first():
    b = batcher(policy="dfs-weight")
    running = []
    for rid, prefix in (("x", range(100, 150)), ("y", range(200, 250))):
        waiting = deque([req(list(prefix) + [1], rid=rid)])
        step(b, running, waiting)
    finish_all(b, running)
    waiting = deque([req(list(range(100, 150)) + [3], rid="x1"), req(list(range(200, 250)) + [3], rid="y1"),
                     req(list(range(200, 250)) + [4], rid="y2"), req(list(range(100, 150)) + [4], rid="x2"),
                     req(list(range(200, 250)) + [5], rid="y3")])
    order = [r.rid for r in b.policy.order(waiting, b.kv)]
    assert order == ["y1", "y2", "y3", "x1", "x2"]


def test_lof_admits_the_longest_outputs_first_so_the_run_has_no_long_tail():
    b = batcher(policy="lof", max_prefill=64, rows=2)  # two rows: admission order decides who runs late
    lens = {"short1": 2, "long": 12, "short2": 2, "mid": 6, "short3": 2}
    waiting = deque([req(range(10 * i, 10 * i + 8), max_new=n, rid=rid) for i, (rid, n) in enumerate(lens.items())])
    assert [r.rid for r in b.policy.order(waiting, b.kv)] == ["long", "mid", "short1", "short2", "short3"]
    fcfs = batcher(policy="fcfs")
    assert [r.rid for r in fcfs.policy.order(waiting, fcfs.kv)] == list(lens)  # (arrival order, for contrast)
    resumed = req(range(900, 908), max_new=12, rid="resumed")
    resumed.output = [5] * 11  # (a retracted request: one token left to generate)
    assert [r.rid for r in b.policy.order([resumed, waiting[1]], b.kv)] == ["long", "resumed"]
    running, steps = [], {}
    for _ in range(40):
        if step(b, running, waiting) is None:
            break
        steps.update({r.rid: len(steps) for r in running if r.rid not in steps})  # (admission order)
        for r in [r for r in running if r.remaining_new_tokens == 0]:
            running.remove(r)
            b.kv.release(r)
    assert sorted(steps, key=steps.get)[:2] == ["long", "mid"] and not waiting


def test_retraction_frees_room_for_decode_and_requeues_the_cheapest():
    b = batcher(pool=200, max_prefill=512)
    running, waiting = [], deque([req(range(10 + 40 * i, 50 + 40 * i), max_new=100, rid=f"r{i}") for i in range(4)])
    for _ in range(2000):
        if step(b, running, waiting) is None:
            break
        if any(len(r.output) >= r.params.max_new_tokens for r in running):
            done = [r for r in running if len(r.output) >= r.params.max_new_tokens]
            for r in done:
                running.remove(r)
                b.kv.release(r)
                r.status = Status.FINISHED
    assert b.counters.retractions > 0
    assert not running and not waiting
    b.kv.check_integrity(running)
    assert b.kv.slots.num_free + b.kv.evictable == b.kv.pool_size


def test_overlap_builds_the_next_step_before_the_last_one_is_known():
    """Overlap scheduling: step N+1 is built while N runs; the token N samples is fed as -1 (the
    worker resolves it on the device) and becomes known when N's results are applied."""
    b = batcher()
    r = req(range(10, 30), max_new=3)
    running, waiting = [], deque([r])
    s1 = b.build(running, waiting)  # prefill, samples token 0
    assert s1.emits == [True] and r.pending == 1
    s2 = b.build(running, waiting)  # built before s1's token is known
    assert from_i32(s2.msg.input_ids).tolist() == [-1] and from_i32(s2.msg.prefix_lens).tolist() == [20]
    assert r.pending == 2 and r.remaining_new_tokens == 1
    apply(b, s1, running, next_token=7)
    s3 = b.build(running, waiting)  # s2 in flight: its token is the next input
    assert from_i32(s3.msg.input_ids).tolist() == [-1] and from_i32(s3.msg.prefix_lens).tolist() == [21]
    assert r.remaining_new_tokens == 0
    apply(b, s2, running, next_token=8)
    assert b.build(running, waiting) is None  # the token in flight is its last: nothing left to decode
    apply(b, s3, running, next_token=9)
    assert r.output == [7, 8, 9] and r.pending == 0
    # what it computed goes into the cache with known ids only (no -1)
    finish_all(b, running)
    assert b.kv.cache.peek("", list(range(10, 30)) + [7, 8]).length == 22


def test_overlap_retracted_request_waits_for_its_token_in_flight():
    b = batcher(pool=64)
    r = req(range(10, 30), max_new=30)
    running, waiting = [], deque([r])
    s1 = b.build(running, waiting)
    b._retract(r, running, waiting)  # (memory pressure while s1 runs)
    assert r.status is Status.WAITING and r.pending == 1
    assert b.build(running, waiting) is None  # not re-admitted before its token is known
    apply(b, s1, running, next_token=7)
    assert r.output == [7] and r.pending == 0
    s = b.build(running, waiting)
    assert s is not None and s.reqs == [r] and -1 not in from_i32(s.msg.input_ids).tolist()
    assert from_i32(s.msg.input_ids).tolist()[-1] == 7


def test_overlap_jump_forward_drops_the_token_sampled_in_flight():
    """Jump-forward after step N appends forced tokens while N+1 (fed N's token) is in flight:
    N+1's sample is dropped and the forced tokens are computed next, after N's token."""
    b = batcher()
    r = req(range(10, 30), max_new=10)
    running, waiting = [], deque([r])
    s1 = b.build(running, waiting)
    s2 = b.build(running, waiting)  # decodes N's token (-1)
    apply(b, s1, running, next_token=7)
    r.output += [40, 41]  # forced by the grammar after 7
    r.discard = r.pending  # what the scheduler does on jump-forward
    s3 = b.build(running, waiting)
    assert from_i32(s3.msg.input_ids).tolist() == [40, 41] and from_i32(s3.msg.prefix_lens).tolist() == [21]
    assert s3.emits == [True]
    # s2's token is dropped, s3's is the next one
    for s, tok in ((s2, 99), (s3, 8)):
        for q, sample in zip(s.reqs, s.emits):
            if sample:
                q.pending -= 1
                if q.discard:
                    q.discard -= 1
                else:
                    q.output.append(tok)
    assert r.output == [7, 40, 41, 8] and r.pending == 0 and r.to_compute == 1
    s4 = b.build(running, waiting)
    assert from_i32(s4.msg.input_ids).tolist() == [8] and from_i32(s4.msg.prefix_lens).tolist() == [23]
