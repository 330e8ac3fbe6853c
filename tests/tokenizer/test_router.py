"""Data-parallel routing: the router's choices (prefix affinity, load, rendezvous fallback, LRU
bounds, groups down) and the tokenizer's link to several schedulers, against fake schedulers on
ZMQ (ready when all agree, requests and aborts to the right group, load summed, a silent group
routed around)."""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys

import pytest
import zmq
import zmq.asyncio

from shared.config import ConfigError, TokenizerConfig
from shared.messages.codec import Codec
from shared.messages.common import FinishReason, SamplingParams
from shared.messages.to_scheduler import AbortReq, GenerateReq, LoadReq, ToScheduler, TokenizerHello
from shared.messages.to_tokenizer import Load, ModelInfo, ToTokenizer, TokenOut, TokenOutBatch
from services.tokenizer import loads as load_probe, scheduler_client
from services.tokenizer.router import Router, block_hashes, rendezvous
from services.tokenizer.scheduler_client import SchedulerClient
from tests.support import ROOT

B = 16  # block tokens in these tests


def prompt(seed: int, n: int = 200) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, 50000) for _ in range(n)]


# ---- hashing -----------------------------------------------------------------------------------
def test_block_hashes_are_chained_per_namespace_and_full_blocks_only():
    a, b = prompt(1, 100), prompt(2, 100)
    ha = block_hashes(a, "", B)
    assert len(ha) == 100 // B  # the partial tail block is not hashed
    mixed = a[:3 * B] + b[3 * B:]
    hm = block_hashes(mixed, "", B)
    assert hm[:3] == ha[:3] and all(x != y for x, y in zip(hm[3:], ha[3:]))  # a block names its whole prefix
    assert block_hashes(a, "tenant", B)[0] != ha[0]
    assert block_hashes(a[:B - 1], "", B) == []


def test_hashes_and_rendezvous_are_the_same_in_every_process():
    code = ("from services.tokenizer.router import block_hashes, rendezvous;"
            "h = block_hashes(list(range(100)), 'ns', 16); print(h, rendezvous(h[0], [0, 1, 2, 3]))")
    outs = {subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                           env=dict(os.environ, PYTHONHASHSEED=seed, PYTHONPATH=str(ROOT))).stdout
            for seed in ("1", "2")}
    h = block_hashes(list(range(100)), "ns", 16)
    assert outs == {f"{h} {rendezvous(h[0], [0, 1, 2, 3])}\n"}


# ---- choices -----------------------------------------------------------------------------------
def test_one_group_routes_everything_there():
    r = Router(1, B)
    assert r.route(prompt(1)).group == 0 and r.route(prompt(1)).reason == "only"


def test_shared_prefix_goes_where_it_went_first():
    r = Router(4, B)
    base = prompt(1, 160)
    first = r.route(base + [1, 2, 3])
    assert first.reason == "hash" and first.matched_tokens == 0
    for i in range(10):
        again = r.route(base + prompt(100 + i, 40))
        assert again.group == first.group and again.reason == "prefix"
        assert again.matched_tokens == 160  # the 10 blocks of the shared prefix


def test_unrelated_prompts_spread_over_all_groups():
    r = Router(4, B)
    groups = [r.route(prompt(i)).group for i in range(64)]
    assert set(groups) == {0, 1, 2, 3}
    assert max(groups.count(g) for g in range(4)) < 32


def test_independent_replicas_agree_on_new_prefixes():
    r1, r2 = Router(4, B), Router(4, B)
    for i in range(32):
        r1.route(prompt(i) + [7])  # r1 saw them; r2 did not
    for i in range(32):
        assert r2.route(prompt(i) + [8, 9]).group == r1.route(prompt(i) + [10]).group
    # a prompt shorter than a block: the rendezvous hash of the whole prompt
    assert r1.route([5, 6, 7]).group == r2.route([5, 6, 7]).group


def test_matches_count_leading_blocks_per_group():
    r = Router(3, B)
    h = block_hashes(prompt(20, 10 * B), "", B)
    r._record(0, h[:3])
    r._record(1, h[:10])
    r._record(2, h[1:6])  # without the first block nothing after it can be reused
    assert r.matches(h) == [3, 10, 0]
    assert r.matches(h[:2]) == [2, 2, 0]
    assert r.matches(block_hashes(prompt(21, 4 * B), "", B)) == [0, 0, 0]


def test_longest_match_wins():
    r = Router(2, B)
    a = prompt(1, 64)
    g = r.route(a).group
    # the other group gets a longer version of it (forced: the first is far busier)
    r.started(g, 100)
    deeper = r.route(a + prompt(2, 64))
    assert deeper.group == 1 - g and deeper.reason == "load"
    r.ended(g, 100)
    r.started(1 - g, 10)  # busier, but not far above
    pick = r.route(a + prompt(2, 64) + [1])
    assert pick.group == 1 - g and pick.matched_tokens == 128 and pick.reason == "prefix"


def test_load_overrides_affinity_only_when_far_above():
    r = Router(2, B, balance_abs=4, balance_rel=1.5)
    base = prompt(3, 96)
    g = r.route(base).group
    r.started(g, 4)  # 4 more than the other: not more than balance_abs
    assert r.route(base + [1]).group == g
    r.started(g, 1)  # 5 more, and more than 1.5 × 0
    moved = r.route(base + [2])
    assert moved.group == 1 - g and moved.reason == "load" and moved.matched_tokens == 0
    r2 = Router(2, B, balance_abs=4, balance_rel=1.5)
    g = r2.route(base).group
    r2.started(g, 15)
    r2.started(1 - g, 10)  # 5 more: over the absolute margin, but not more than 1.5 ×
    assert r2.route(base + [3]).group == g


def test_equal_matches_go_to_the_least_loaded():
    r = Router(2, B, balance_abs=0, balance_rel=1.0)
    base = prompt(4, 64)
    g = r.route(base).group
    r.started(g, 1)
    assert r.route(base).group == 1 - g  # forced over: now both hold it
    r.started(1 - g, 3)
    assert r.route(base + [1]).group == g  # the same match, less load


def test_other_replicas_load_counts():
    r = Router(2, B, balance_abs=2, balance_rel=1.0)
    base = prompt(5, 64)
    g = r.route(base).group
    r.observed(g, scheduler_load=10, mine_at_probe=0)  # another replica keeps it busy
    assert r.loads()[g] == 10
    assert r.route(base + [1]).group == 1 - g
    r.started(g, 3)
    r.observed(g, scheduler_load=3, mine_at_probe=3)  # all of it is ours
    assert r.loads()[g] == 3


def test_memory_is_bounded_by_the_pool_and_lru():
    r = Router(2, B, max_blocks=1000)
    r.set_pool(0, 8 * B)  # room for 8 blocks
    r.set_pool(1, 10**9)
    assert r.groups[1].capacity == 1000
    assert r.groups[0].capacity == 8
    old, new = prompt(6, 4 * B), prompt(7, 6 * B)
    r.groups[1].up = False  # make group 0 the only choice for a moment
    r.route(old)
    r.route(new)
    assert r.blocks(0) == 8
    assert r.matches(block_hashes(new, "", B))[0] == 6
    assert r.matches(block_hashes(old, "", B))[0] == 2  # its deep blocks went first; its prefix is still there
    r.route(prompt(8, 8 * B))
    assert r.matches(block_hashes(old, "", B))[0] == 0
    assert len(r._where) == r.blocks(0) + r.blocks(1)


def test_a_group_down_is_routed_around_and_forgotten():
    r = Router(2, B)
    base = prompt(9, 64)
    g = r.route(base).group
    r.set_up(g, False)
    assert r.blocks(g) == 0
    moved = r.route(base)
    assert moved.group == 1 - g and moved.reason == "only"
    r.set_up(1 - g, False)
    with pytest.raises(LookupError):
        r.route(base)
    r.set_up(g, True)
    assert r.route(base).group == g


def test_config_lists_endpoints():
    cfg = TokenizerConfig(scheduler_endpoint="ipc:///a, ipc:///b")
    assert cfg.scheduler_endpoints == ["ipc:///a", "ipc:///b"]
    with pytest.raises(ConfigError):
        TokenizerConfig(scheduler_endpoint="ipc:///a,ipc:///a")
    with pytest.raises(ConfigError):
        TokenizerConfig(scheduler_endpoint=" , ")


# ---- the client against fake schedulers ---------------------------------------------------------
def info(**kw) -> ModelInfo:
    base = dict(model="m", architecture="A", vocab_size=100, context_length=512, pool_size=1000,
                max_running_requests=8, eos_token_ids=[1], device="cpu", dtype="float32")
    return ModelInfo(**(base | kw))


class FakeScheduler:
    """A ROUTER that answers like a scheduler: ModelInfo to a hello, one TokenOut ending each
    request unless ``hold`` (then it waits for an abort), Load with its running count."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, model: ModelInfo) -> None:
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(endpoint)
        self.info, self.hold, self.silent = model, False, False
        self.gens: list[GenerateReq] = []
        self.aborts: list[AbortReq] = []
        self.running: dict[str, bytes] = {}
        self.recv, self.send = Codec(ToScheduler), Codec(ToTokenizer)
        self.task = asyncio.create_task(self._loop())

    async def _loop(self) -> None:
        while True:
            ident, frame = await self.sock.recv_multipart()
            msg = self.recv.decode(frame)
            if self.silent:
                continue
            if isinstance(msg, TokenizerHello):
                out = self.info
            elif isinstance(msg, GenerateReq):
                self.gens.append(msg)
                if self.hold:
                    self.running[msg.rid] = ident
                    continue
                out = TokenOutBatch([TokenOut(rid=msg.rid, token_ids=[5], finish=FinishReason.LENGTH)])
            elif isinstance(msg, AbortReq):
                self.aborts.append(msg)
                if self.running.pop(msg.rid, None) is None:
                    continue
                out = TokenOutBatch([TokenOut(rid=msg.rid, finish=FinishReason.ABORT)])
            elif isinstance(msg, LoadReq):
                out = Load(token=msg.token, num_running=len(self.running), num_waiting=0, kv_free=10, kv_used=5,
                           kv_pool=15, kv_evictable=0, steps=3, prefill_computed_tokens=7, prefill_cached_tokens=2,
                           decode_tokens=1, retractions=0, evicted_tokens=0)
            else:
                continue
            await self.sock.send_multipart([ident, self.send.encode(out)])

    def close(self) -> None:
        self.task.cancel()
        self.sock.close()


async def until(cond, what: str) -> None:
    for _ in range(1000):  # a generous bound, not a timing claim
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never happened: {what}")


def with_fakes(tmp_path, infos: list[ModelInfo], body, probe_interval: float = 0.0) -> None:
    async def main() -> None:
        ctx = zmq.asyncio.Context()
        eps = [f"ipc://{tmp_path}/s{i}.ipc" for i in range(len(infos))]
        fakes = [FakeScheduler(ctx, e, i) for e, i in zip(eps, infos)]
        client = SchedulerClient(",".join(eps), "tok-test", Router(len(eps), B), probe_interval)
        await client.start()
        try:
            await asyncio.wait_for(body(client, fakes), 60)
        finally:
            await client.close()
            for f in fakes:
                f.close()
            ctx.term()

    asyncio.run(main())


async def drain(client: SchedulerClient, rid: str, queue) -> list[TokenOut]:
    outs = []
    async for out in client.stream(queue):
        outs.append(out)
        if out.finish:
            break
    client.release(rid)
    return outs


def test_client_routes_and_aborts_in_the_right_group(tmp_path):
    async def body(client: SchedulerClient, fakes: list[FakeScheduler]) -> None:
        await client.wait_ready()
        assert client.info.pool_size == 900 and client.info.model == "m"  # the smaller pool
        params = SamplingParams(max_new_tokens=1)
        base = prompt(11, 64)
        q = client.submit(GenerateReq(rid="a", input_ids=base + [1], params=params))
        assert (await drain(client, "a", q))[-1].finish == "length"
        home = [i for i, f in enumerate(fakes) if f.gens][0]
        for i in range(4):  # the same prefix: the same group
            q = client.submit(GenerateReq(rid=f"b{i}", input_ids=base + [2, i], params=params))
            await drain(client, f"b{i}", q)
        assert len(fakes[home].gens) == 5 and not fakes[1 - home].gens
        fakes[home].hold = True
        q = client.submit(GenerateReq(rid="held", input_ids=base + [3], params=params, n=2))
        assert client.router.groups[home].in_flight == 2
        client.abort("held")
        assert (await drain(client, "held", q))[-1].finish == "abort"
        assert [a.rid for a in fakes[home].aborts] == ["held"] and not fakes[1 - home].aborts
        assert client.router.groups[home].in_flight == 0
        client.abort("gone")  # released already: every group is told
        await until(lambda: all(any(a.rid == "gone" for a in f.aborts) for f in fakes), "abort broadcast")
        total = await client.load()
        assert total.kv_pool == 30 and total.prefill_computed_tokens == 14

    with_fakes(tmp_path, [info(), info(pool_size=900)], body)


def test_groups_that_disagree_fail_readiness(tmp_path):
    async def body(client: SchedulerClient, fakes) -> None:
        with pytest.raises(ConfigError, match="vocab_size"):
            await client.wait_ready()
        assert not client.ready.is_set()

    with_fakes(tmp_path, [info(), info(vocab_size=101)], body)


def test_a_silent_group_is_routed_around_and_comes_back(tmp_path, monkeypatch):
    monkeypatch.setattr(load_probe, "DOWN_AFTER_S", 0.3)
    health: list[bool] = []

    async def body(client: SchedulerClient, fakes: list[FakeScheduler]) -> None:
        await client.wait_ready()
        client.on_health = health.append
        params = SamplingParams(max_new_tokens=1)
        base = prompt(12, 64)
        route = client.route(base)
        g = route.group
        fakes[g].hold = True
        q = client.submit(GenerateReq(rid="x", input_ids=base, params=params), route)
        fakes[g].silent = True
        outs = await drain(client, "x", q)  # ended by the tokenizer: its group stopped answering
        assert outs[-1].finish == "error" and outs[-1].error_code == "unavailable"
        assert not client.links[g].up
        q = client.submit(GenerateReq(rid="y", input_ids=base, params=params))
        assert (await drain(client, "y", q))[-1].finish == "length"
        assert [r.rid for r in fakes[1 - g].gens] == ["y"]
        fakes[1 - g].silent = True
        await until(lambda: not client.ready.is_set(), "every group down")
        with pytest.raises(Exception, match="no data-parallel group"):
            client.submit(GenerateReq(rid="z", input_ids=base, params=params))
        fakes[g].silent = fakes[1 - g].silent = False
        await until(lambda: all(link.up for link in client.links), "groups back")
        assert client.ready.is_set() and health == [False, True]

    with_fakes(tmp_path, [info(), info()], body, probe_interval=0.05)
