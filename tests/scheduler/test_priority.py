"""Priority scheduling without processes: the order (levels, the policy within a level, aging),
preemption (a free running slot or KV headroom for a waiting request that outranks running ones;
never useless, never of aged requests, the threshold), retraction choosing low priority first,
and shedding from a full queue."""

from __future__ import annotations

from collections import deque

from services.scheduler.batcher import Batcher, Limits
from services.scheduler.kv import KVManager
from services.scheduler.policy import POLICIES
from services.scheduler.priority import AGED, Preemptor, PriorityPolicy, shed_victims
from services.scheduler.request import Req, Status
from services.scheduler.requests import RequestTable
from shared.messages.common import SamplingParams


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def req(prompt, priority=0, max_new=64, rid="r", at=0.0) -> Req:
    r = Req(rid=rid, replica=b"t", prompt=list(prompt), params=SamplingParams(max_new_tokens=max_new),
            priority=priority)
    if at:
        r.arrival = r.queued_at = at
    return r


def batcher(pool=4096, rows=64, policy="fcfs", threshold=10, aging=0.0, clock=None, max_running=None, cap=None,
            prefill=1024, chunk=1024, urgent=False, window=0.0):
    kv = KVManager(pool, rows)
    clock = clock or Clock()
    order = PriorityPolicy(POLICIES[policy](), aging, clock)
    pre = Preemptor(order, threshold) if threshold else None
    limits = Limits(max_running or rows, prefill, chunk, low_priority_prefill=cap, low_priority_window=window,
                    urgent_steps=urgent)
    return Batcher(kv, order, limits, preemptor=pre, clock=clock)


def step(b: Batcher, running, waiting, token=5):
    s = b.build(running, waiting)
    if s is None:
        return None
    for r, n, sample in zip(s.reqs, s.extend, s.emits):
        if n > 1 or not r.output:
            b.kv.cache_prefix(r)
        if sample:
            r.pending -= 1
            r.output.append(token)
    b.kv.check_integrity(running)
    return s


def rids(reqs) -> list[str]:
    return [r.rid for r in reqs]


def test_order_is_by_level_then_the_policy_within_a_level():
    clock = Clock()
    b = batcher(policy="lpm", clock=clock)
    running = []
    step(b, running, deque([req(range(500, 600), rid="warm")]))  # caches 500..599
    for r in list(running):
        running.remove(r)
        b.kv.release(r)
    waiting = deque([req(range(700, 800), 0, rid="low-cold"), req(list(range(500, 600)) + [1], 0, rid="low-hit"),
                     req(range(800, 900), 5, rid="mid"), req(range(900, 950), 10, rid="high-cold"),
                     req(list(range(500, 600)) + [2], 10, rid="high-hit")])
    assert rids(b.policy.order(waiting, b.kv)) == ["high-hit", "high-cold", "mid", "low-hit", "low-cold"]
    # one level: the inner policy alone
    same = deque([r for r in waiting if r.priority == 0])
    assert rids(b.policy.order(same, b.kv)) == rids(POLICIES["lpm"]().order(same, b.kv))


def test_aging_puts_a_request_ahead_of_every_level_and_shields_it_from_preemption():
    clock = Clock()
    b = batcher(aging=30.0, clock=clock, max_running=1)
    old = req(range(10, 50), 0, rid="old", at=clock.t - 10)
    new = req(range(60, 100), 10, rid="new", at=clock.t - 1)
    waiting = deque([old, new])
    assert rids(b.policy.order(waiting, b.kv)) == ["new", "old"]
    clock.t += 25  # old has waited 35 s: aged
    assert rids(b.policy.order(waiting, b.kv)) == ["old", "new"] and old.aged and not new.aged
    running: list[Req] = []
    waiting = deque([old])
    step(b, running, waiting)
    assert running == [old]
    waiting.append(req(range(200, 240), 100, rid="urgent", at=clock.t))
    for _ in range(3):
        step(b, running, waiting)
    assert running == [old] and b.counters.preemptions == 0  # an aged request is not preempted


def test_preemption_frees_a_running_slot_for_a_higher_priority_request():
    b = batcher(max_running=2)
    running: list[Req] = []
    waiting = deque([req(range(10, 40), 0, rid="a")])
    for _ in range(3):
        step(b, running, waiting)
    waiting += [req(range(50, 80), 0, rid="b"), req(range(90, 120), 0, rid="c")]
    step(b, running, waiting)
    assert rids(running) == ["a", "b"] and rids(waiting) == ["c"]
    a_out = list(running[0].output)
    urgent = req(range(300, 340), 10, rid="urgent")
    waiting.append(urgent)
    s = step(b, running, waiting)
    assert urgent in s.reqs and urgent.status is Status.RUNNING and b.counters.preemptions == 1
    victim = next(r for r in (running[0], *waiting) if r.rid in ("a", "b") and r.status is Status.WAITING)
    assert victim.rid == "b" and victim.retractions == 1  # least progress among the lowest level
    assert rids(waiting)[0] == "b" and rids(waiting)[1] == "c"  # it resumes first among its level
    assert running[0].rid == "a" and running[0].output[:len(a_out)] == a_out


def test_the_threshold_decides_who_preempts_whom():
    b = batcher(max_running=1, threshold=10)
    running: list[Req] = []
    waiting = deque([req(range(10, 40), 0, rid="low")])
    step(b, running, waiting)
    waiting.append(req(range(50, 80), 9, rid="nine"))
    step(b, running, waiting)
    assert rids(running) == ["low"] and b.counters.preemptions == 0
    waiting.append(req(range(90, 120), 10, rid="ten"))
    step(b, running, waiting)
    assert rids(running) == ["ten"] and b.counters.preemptions == 1
    assert rids(b.policy.order(waiting, b.kv)) == ["nine", "low"]  # 9 does not preempt 0, but goes first


def test_preemption_makes_kv_headroom_and_the_victim_keeps_its_output():
    # a pool of 300: two low-priority requests (40 + up to 100 tokens each) hold most of it
    b = batcher(pool=300, max_running=8)
    running: list[Req] = []
    waiting = deque([req(range(10, 50), 0, max_new=100, rid="a"), req(range(60, 100), 0, max_new=100, rid="b")])
    for _ in range(30):
        step(b, running, waiting)
    outputs = {r.rid: list(r.output) for r in running}
    urgent = req(range(400, 520), 10, max_new=40, rid="urgent")
    waiting.append(urgent)
    step(b, running, waiting)
    assert urgent.status is Status.RUNNING and b.counters.preemptions >= 1
    preempted = [r for r in waiting if r.rid in outputs]
    assert preempted and all(r.output == outputs[r.rid] and r.retractions == 1 for r in preempted)
    # its KV went into the cache: resuming recomputes little
    assert all(b.kv.peek_prefix(r) >= 40 for r in preempted)


def test_no_preemption_that_would_not_make_room():
    b = batcher(pool=200, max_running=8)
    running: list[Req] = []
    waiting = deque([req(range(10, 30), 0, max_new=20, rid="a")])
    step(b, running, waiting)
    huge = req(range(300, 480), 10, max_new=100, rid="huge")  # 280 tokens: more than the pool
    waiting.append(huge)
    step(b, running, waiting)
    assert rids(running) == ["a"] and b.counters.preemptions == 0 and huge.status is Status.WAITING


def test_decode_pressure_retracts_the_lowest_priority_first():
    b = batcher(pool=160, threshold=0)
    b.new_token_ratio = 0.1  # (admit both at once: their decode then outgrows the pool)
    running: list[Req] = []
    waiting = deque([req(range(10, 50), 5, max_new=200, rid="high"), req(range(60, 100), 0, max_new=200, rid="low")])
    for _ in range(100):
        step(b, running, waiting)
        if b.counters.retractions:
            break
    assert b.counters.retractions >= 1
    assert all(r.rid == "low" for r in waiting) and any(r.rid == "high" for r in running)


def test_shedding_picks_the_lowest_priority_newest_requests_that_never_started():
    table = RequestTable(lambda ident, msg: None)
    reqs = [req(range(10, 20), p, rid=f"r{i}", at=100.0 + i) for i, p in enumerate([0, 0, 1, 5, 0])]
    for r in reqs:
        table.add([r])
        table.enqueue([r])
    reqs[4].retractions = 1  # started once (it may have streamed): never shed
    assert shed_victims(table, 2, priority=3) == ["r1", "r0"]
    assert shed_victims(table, 3, priority=3) == ["r1", "r0", "r2"]
    assert shed_victims(table, 4, priority=3) is None  # r3 (5) outranks, r4 started: not enough
    assert shed_victims(table, 1, priority=0) is None  # nothing below priority 0


def test_aged_level_is_above_every_priority():
    assert AGED > 10**9


def test_the_highest_level_gets_the_step_first_and_lower_levels_share_the_cap():
    b = batcher(pool=20000, cap=256, prefill=1024, chunk=1024)
    running, waiting = [], deque([req(range(1000, 3000), 0, rid="bg1"), req(range(3000, 5000), 0, rid="bg2")])
    s = step(b, running, waiting)  # one level: no cap (the budget as without priorities)
    assert rids(s.reqs) == ["bg1"] and s.extend == [1024]
    waiting.append(req(range(6000, 6600), 10, rid="urgent"))
    s = step(b, running, waiting)  # the urgent prompt goes first; bg1's next chunk gets what the cap leaves
    assert rids(s.reqs) == ["urgent", "bg1"] and s.extend == [600, 256]
    s = step(b, running, waiting)  # the urgent request decodes: the background shares 256 tokens a step
    assert rids(s.reqs) == ["urgent", "bg1"] and s.extend == [1, 256] and s.prefill_tokens == 256
    for r in [r for r in running if r.rid == "urgent"]:
        running.remove(r)
        b.kv.release(r)
    s = step(b, running, waiting)  # the urgent request is gone: the whole budget again (bg1's last 464, then bg2)
    assert rids(s.reqs) == ["bg1", "bg2"] and s.extend == [464, 560]


def test_the_cap_outlives_the_urgent_request_for_the_window():
    clock = Clock()
    b = batcher(pool=40000, cap=256, prefill=1024, chunk=1024, window=10.0, clock=clock)
    running, waiting = [], deque([req(range(1000, 9000), 0, rid="bg")])
    s = step(b, running, waiting)  # never a higher level yet: the whole budget
    assert s.prefill_tokens == 1024
    waiting.append(req(range(20000, 20100), 10, max_new=2, rid="urgent"))
    s = step(b, running, waiting)
    assert rids(s.reqs) == ["urgent", "bg"] and s.extend == [100, 256]
    for r in [r for r in running if r.rid == "urgent"]:
        running.remove(r)
        b.kv.release(r)
    clock.t += 9.0  # gone for 9 s: the background's chunks stay capped
    s = step(b, running, waiting)
    assert rids(s.reqs) == ["bg"] and s.extend == [256]
    clock.t += 1.5  # gone for 10.5 s > the window: the whole budget again
    s = step(b, running, waiting)
    assert rids(s.reqs) == ["bg"] and s.extend == [1024]
    # an aged request is above every level, but not a level the window keeps the cap on for
    b2 = batcher(pool=40000, cap=256, prefill=1024, chunk=1024, window=10.0, clock=clock)
    aged = req(range(30000, 30050), 0, rid="aged")
    aged.aged = True
    running2, waiting2 = [], deque([aged, req(range(31000, 33000), 0, rid="bg2")])
    step(b2, running2, waiting2)
    running2.remove(aged)
    b2.kv.release(aged)
    s = step(b2, running2, waiting2)
    assert rids(s.reqs) == ["bg2"] and s.prefill_tokens == 1024


def test_without_a_cap_levels_are_still_served_in_order():
    b = batcher(pool=20000, cap=0, prefill=1024, chunk=1024)
    running, waiting = [], deque([req(range(1000, 3000), 0, rid="bg")])
    step(b, running, waiting)
    waiting.append(req(range(6000, 6600), 10, rid="urgent"))
    s = step(b, running, waiting)
    assert rids(s.reqs) == ["urgent", "bg"] and s.extend == [600, 424]


def test_a_steps_outputs_go_out_urgent_first():
    from shared.messages.to_tokenizer import TokenOut

    sent = []
    table = RequestTable(lambda ident, msg: sent.append((ident, [o.rid for o in msg.outs])))
    for rid, prio in (("bg1", 0), ("hi1", 10), ("bg2", 0), ("mid", 5), ("hi2", 10), ("neg", -3)):
        table.emit(b"t", TokenOut(rid=rid), prio)
    table.emit(b"u", TokenOut(rid="only-urgent"), 7)
    table.flush()
    assert sent == [(b"t", ["hi1", "hi2", "mid", "bg1", "bg2", "neg"]), (b"u", ["only-urgent"])]
    table.emit(b"t", TokenOut(rid="next"))
    table.flush()
    assert sent[-1] == (b"t", ["next"])  # (nothing left over from the last step)


def test_lower_levels_are_admitted_after_the_top_one_with_or_without_a_cap():
    for cap in (0, 256):
        b = batcher(pool=20000, cap=cap, prefill=1024, chunk=1024)
        running, waiting = [], deque([req(range(6000, 6100), 10, rid="urgent"), req(range(1000, 1200), 0, rid="bg")])
        s = step(b, running, waiting)  # no lower-level chunk running: the background is admitted all the same
        assert rids(s.reqs) == ["urgent", "bg"] and s.extend == [100, 200], cap


def test_a_top_level_request_that_does_not_fit_is_not_overtaken_by_lower_ones():
    b = batcher(pool=1200, cap=256, prefill=1024, chunk=1024, threshold=0)  # (no preemption)
    running, waiting = [], deque([req(range(1000, 1700), 0, max_new=8, rid="bg-running")])
    step(b, running, waiting)
    waiting.extend([req(range(6000, 6700), 10, max_new=8, rid="urgent"), req(range(2000, 2050), 0, max_new=8, rid="bg")])
    s = step(b, running, waiting)  # the urgent prompt does not fit next to the running one: nobody is admitted
    assert rids(s.reqs) == ["bg-running"] and rids(waiting) == ["urgent", "bg"]


def test_an_urgent_request_gets_a_step_without_the_lower_levels_at_most_every_other_step():
    b = batcher(cap=2048, urgent=True, threshold=0)
    running, waiting = [], deque([req(range(i * 100, i * 100 + 50), 0, max_new=64, rid=f"bg{i}") for i in range(4)])
    step(b, running, waiting)  # the background prefills
    assert rids(running) == ["bg0", "bg1", "bg2", "bg3"]
    step(b, running, waiting)  # ... and decodes
    waiting.extend([req(range(900, 960), 10, rid="hi1"), req(range(960, 990), 10, rid="hi2")])
    s = step(b, running, waiting)  # the urgent step: their prompts alone
    assert rids(s.reqs) == ["hi1", "hi2"] and all(n > 1 for n in s.extend)
    s = step(b, running, waiting)  # the next: everyone decodes (the lower levels wait one step at most)
    assert sorted(rids(s.reqs)) == ["bg0", "bg1", "bg2", "bg3", "hi1", "hi2"] and set(s.extend) == {1}
    waiting.append(req(range(1000, 1040), 10, rid="hi3"))
    s = step(b, running, waiting)  # another urgent arrival: its own step again, the top level decoding in it
    assert sorted(rids(s.reqs)) == ["hi1", "hi2", "hi3"]
    waiting.append(req(range(1100, 1140), 10, rid="hi4"))
    s = step(b, running, waiting)  # one arriving a step later: its own step too (two in a row)
    assert sorted(rids(s.reqs)) == ["hi1", "hi2", "hi3", "hi4"] and b.counters.urgent_steps == 3
    waiting.append(req(range(1200, 1240), 10, rid="hi5"))
    s = step(b, running, waiting)  # but never three: hi5 joins a full step (the background waited two)
    assert sorted(rids(s.reqs)) == ["bg0", "bg1", "bg2", "bg3", "hi1", "hi2", "hi3", "hi4", "hi5"]
    waiting.append(req(range(1300, 1340), 10, rid="hi6"))
    s = step(b, running, waiting)  # and after a full step an arrival gets its own again
    assert sorted(rids(s.reqs)) == ["hi1", "hi2", "hi3", "hi4", "hi5", "hi6"] and b.counters.urgent_steps == 4


def test_no_urgent_step_when_the_urgent_request_cannot_start_or_the_flag_is_off():
    for urgent, max_running in ((True, 4), (False, 64)):
        b = batcher(cap=2048, urgent=urgent, threshold=0, max_running=max_running)
        running, waiting = [], deque([req(range(i * 100, i * 100 + 50), 0, rid=f"bg{i}") for i in range(4)])
        step(b, running, waiting)
        waiting.append(req(range(900, 960), 10, rid="hi"))
        s = step(b, running, waiting)  # full (4 running) or the flag off: the background decodes as usual
        assert {"bg0", "bg1", "bg2", "bg3"} <= set(rids(s.reqs))
        assert ("hi" in rids(s.reqs)) == (max_running > 4)
