"""Sessions and pinned prefixes in the scheduler, without processes: turns committed and pinned
(eviction cannot touch them), branching, capacity and budget refusals, expiry, close, pins and
their TTL; the KV invariant holds throughout."""

from __future__ import annotations


from services.scheduler.batcher import Batcher, Limits
from services.scheduler.kv import KVManager
from services.scheduler.pins import PinBudget, Pins, budget_limit
from services.scheduler.policy import POLICIES
from services.scheduler.request import Req
from services.scheduler.requests import RequestTable
from services.scheduler.sessions import MAX_TURNS, Sessions
from shared.messages.common import ErrorCode, FinishReason, SamplingParams
from shared.messages.to_scheduler import GenerateReq, PinSpec, SessionOp, SessionOpKind, SessionTurn


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class World:
    """A KV manager, a batcher, a request table, sessions and pins on one budget."""

    def __init__(self, pool=2000, limit=500, context=1024) -> None:
        self.clock = Clock()
        self.kv = KVManager(pool, 16)
        self.budget = PinBudget(limit)
        self.sessions = Sessions(self.kv, self.budget, context, self.clock)
        self.pins = Pins(self.kv, self.budget, self.clock)
        self.batcher = Batcher(self.kv, POLICIES["fcfs"](), Limits(16, 4096, 4096))
        self.table = RequestTable(lambda ident, msg: None)

    def op(self, kind: SessionOpKind, sid: str = "s", **kw):
        return self.sessions.handle(SessionOp(token="t", op=kind, session_id=sid, **kw))

    def run(self, r: Req, tokens: list[int], reason=FinishReason.LENGTH) -> None:
        """Run ``r`` to the end, sampling ``tokens``, then end it the way the scheduler does."""
        self.table.add([r])
        self.table.enqueue([r])
        out = list(tokens)
        while True:
            s = self.batcher.build(self.table.running, self.table.waiting)
            assert s is not None
            done = False
            for q, n, sample in zip(s.reqs, s.extend, s.emits):
                if n > 1 or not q.output:
                    self.kv.cache_prefix(q)
                if sample:
                    q.pending -= 1
                    if q.params.max_new_tokens == 0:
                        done = True
                    else:
                        q.output.append(out.pop(0))
                        done = not out
            if done:
                break
        self.table.finish(r, reason, self.kv)
        self.kv.check_integrity(self.table.running)

    def turn(self, rid: str, new: list[int], out: list[int], sid="s", parent=None, max_new=None):
        view = self.op(SessionOpKind.INFO, sid, parent=parent or "").session
        msg = GenerateReq(rid=rid, input_ids=new, params=SamplingParams(max_new_tokens=max_new or len(out)),
                          session=SessionTurn(sid, view.parent, view.length))
        prompt, anchor, err = self.sessions.begin(msg)
        if err is not None:
            return err
        self.run(Req(rid=rid, replica=b"t", prompt=prompt, params=msg.params, anchor=anchor), out)
        return prompt


def flood(w: World, n_tokens: int, base: int = 5000) -> None:
    """Unrelated traffic: prompts that fill the pool, each finished (cached, evictable)."""
    done = 0
    i = 0
    while done < n_tokens:
        p = list(range(base + i * 300, base + i * 300 + 300))
        w.run(Req(rid=f"x{i}", replica=b"t", prompt=p, params=SamplingParams(max_new_tokens=2)), [1, 2])
        done += 300
        i += 1


def test_a_turn_is_pinned_and_survives_eviction_pressure():
    w = World()
    assert w.op(SessionOpKind.OPEN, ttl_s=60, capacity=400).error_code is None
    p1 = w.turn("t1", list(range(10, 60)), [7, 8, 9])
    assert w.sessions.get("s").size == w.sessions.tokens == 53 and w.budget.used == 53
    flood(w, 2 * w.kv.pool_size)  # twice the pool of unrelated prompts
    assert w.kv.counters.evicted_tokens > w.kv.pool_size
    history = p1 + [7, 8, 9]
    assert w.kv.cache.peek("", history).length == len(history) - 1  # all but the last sample (never computed)
    p2 = w.turn("t2", [11, 12], [5])
    assert p2 == history + [11, 12]
    v = w.op(SessionOpKind.INFO).session
    assert (v.parent, v.length, v.capacity_left) == ("t2", len(p2) + 1, 400 - len(p2) - 1)


def test_without_a_session_the_flood_evicts_the_conversation():
    w = World()
    prompt = list(range(10, 60))
    w.run(Req(rid="plain", replica=b"t", prompt=prompt, params=SamplingParams(max_new_tokens=3)), [7, 8, 9])
    flood(w, 2 * w.kv.pool_size)
    assert w.kv.cache.peek("", prompt + [7, 8]).length == 0


def test_branches_share_their_parent_and_count_once():
    w = World()
    w.op(SessionOpKind.OPEN, ttl_s=60, capacity=400)
    p1 = w.turn("root", list(range(10, 40)), [1, 2])
    a = w.turn("a", [50, 51], [3], parent="root")
    b = w.turn("b", [60, 61, 62], [4], parent="root")
    assert a[:32] == b[:32] == p1 + [1, 2]
    s = w.sessions.get("s")
    assert s.size == 32 + 3 + 4 and s.head == "b"
    assert w.op(SessionOpKind.INFO, parent="a").session.length == 35


def test_capacity_budget_and_missing_turns_are_refused():
    w = World(limit=300)
    w.op(SessionOpKind.OPEN, ttl_s=60, capacity=100)
    code, msg = w.turn("big", list(range(10, 100)), [1] * 5, max_new=20)
    assert code is ErrorCode.FAILED_PRECONDITION and "is full" in msg and "100" in msg
    w.op(SessionOpKind.OPEN, "s2", ttl_s=60, capacity=300)
    pin = GenerateReq(rid="p", input_ids=list(range(500, 700)), params=SamplingParams(max_new_tokens=0), pin=PinSpec())
    anchor, _ = w.pins.begin(pin)  # 200 of the 300 reserved by a pin being prefilled
    code, msg = w.turn("b2", list(range(10, 100)), [1], sid="s2", max_new=50)
    assert code is ErrorCode.RESOURCE_EXHAUSTED and "--max-pinned-tokens 300" in msg and "200 reserved" in msg
    anchor.ended(Req(rid="p", replica=b"t", prompt=[], params=pin.params), FinishReason.ABORT, w.kv)
    r = w.op(SessionOpKind.INFO, parent="nope")
    assert r.error_code is ErrorCode.NOT_FOUND and "'nope'" in r.error
    r = w.op(SessionOpKind.OPEN, "s3", ttl_s=60, capacity=301)
    assert r.error_code is ErrorCode.INVALID_ARGUMENT and "capacity" in r.error
    assert w.budget.reserved == 0 and w.budget.used == 0


def test_expiry_and_close_unpin_and_say_why():
    w = World()
    w.op(SessionOpKind.OPEN, ttl_s=10, capacity=400)
    w.op(SessionOpKind.OPEN, "c", ttl_s=10, capacity=400)
    w.turn("t1", list(range(10, 60)), [7])
    w.turn("u1", list(range(100, 150)), [7], sid="c")
    locked = w.kv.cache.locked_size
    assert locked >= 100
    w.clock.t = 5.0
    w.sessions.expire(w.clock.t)
    assert w.sessions.get("s") is not None
    closed = w.op(SessionOpKind.CLOSE, "c")
    assert closed.error_code is None and closed.tokens == 51
    w.clock.t = 20.0
    w.sessions.expire(w.clock.t)
    assert w.sessions.get("s") is None and w.kv.cache.locked_size == 0 and w.budget.used == w.sessions.tokens == 0
    r = w.op(SessionOpKind.INFO)
    assert r.error_code is ErrorCode.NOT_FOUND and "expired" in r.error
    assert "closed" in w.op(SessionOpKind.INFO, "c").error
    assert "does not exist" in w.op(SessionOpKind.INFO, "never").error
    w.kv.check_integrity([])


def test_an_aborted_turn_adds_nothing_and_a_stop_string_cut_is_respected():
    w = World()
    w.op(SessionOpKind.OPEN, ttl_s=60, capacity=400)
    view = w.op(SessionOpKind.INFO).session
    msg = GenerateReq(rid="x", input_ids=[5, 6, 7], params=SamplingParams(max_new_tokens=4),
                      session=SessionTurn("s", view.parent, view.length))
    prompt, anchor, _ = w.sessions.begin(msg)
    w.run(Req(rid="x", replica=b"t", prompt=prompt, params=msg.params, anchor=anchor), [1, 2, 3, 4],
          FinishReason.ABORT)
    assert w.sessions.get("s").size == 0 and w.budget.reserved == 0
    prompt, anchor, _ = w.sessions.begin(msgspec_replace(msg, rid="y"))
    r = Req(rid="y", replica=b"t", prompt=prompt, params=msg.params, anchor=anchor)
    r.keep_output = 2  # the tokenizer matched a stop string after 2 tokens
    w.run(r, [1, 2, 3, 4], FinishReason.STOP)
    assert w.sessions.get("s").turns["y"].tokens == [5, 6, 7, 1, 2]


def test_a_session_forgets_its_oldest_turns_past_the_limit():
    w = World(pool=4000, limit=2000)
    w.op(SessionOpKind.OPEN, ttl_s=60, capacity=2000)
    for i in range(MAX_TURNS + 3):
        w.turn(f"t{i}", [10 + i], [1])
    s = w.sessions.get("s")
    assert len(s.turns) == MAX_TURNS + 1 and "t0" not in s.turns and f"t{MAX_TURNS + 2}" in s.turns
    w.kv.check_integrity([])


def test_pins_commit_unpin_expire_and_respect_the_budget():
    w = World(limit=200)
    msg = GenerateReq(rid="p1", input_ids=list(range(10, 110)), params=SamplingParams(max_new_tokens=0),
                      pin=PinSpec(ttl_s=30))
    anchor, err = w.pins.begin(msg)
    assert err is None and w.budget.reserved == 100
    too_big = GenerateReq(rid="p2", input_ids=list(range(200, 320)), params=SamplingParams(max_new_tokens=0),
                          pin=PinSpec())
    _, err = w.pins.begin(too_big)
    assert err[0] is ErrorCode.RESOURCE_EXHAUSTED
    w.run(Req(rid="p1", replica=b"t", prompt=list(msg.input_ids), params=msg.params, anchor=anchor), [])
    assert "p1" in w.pins.pins and w.budget.used == w.pins.tokens == 100 and w.budget.reserved == 0
    flood(w, 2 * w.kv.pool_size)
    assert w.kv.cache.peek("", list(range(10, 110))).length == 100  # the whole prompt, pinned
    w.clock.t = 31.0
    w.pins.expire(w.clock.t)
    assert not w.pins.pins and w.budget.used == w.pins.tokens == 0 and w.kv.cache.locked_size == 0
    tokens, err = w.pins.unpin("p1")
    assert err[0] is ErrorCode.NOT_FOUND and tokens == 0


def test_the_budget_defaults_to_a_quarter_of_the_pool_and_never_passes_half():
    assert budget_limit(0, 1000) == 250 and budget_limit(100, 1000) == 100 and budget_limit(900, 1000) == 500


def msgspec_replace(msg, **kw):
    import msgspec

    return msgspec.structs.replace(msg, **kw)
