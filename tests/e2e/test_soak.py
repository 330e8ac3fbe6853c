"""Soak and deadlines: thousands of mixed requests (lengths, n > 1, structured output, gRPC and
HTTP) with about a fifth of the clients giving up at random moments (cancel, deadline, Abort,
HTTP disconnect) under a KV pool small enough that the prefix cache evicts all the time;
afterwards the engine is idle and whole. Then gRPC deadlines: a request whose deadline passes,
running or queued, is aborted in the scheduler.

"Whole" is checked three ways: GetLoad (nothing running or waiting, every KV slot free or held
only by the prefix cache, reclaimable), the scheduler's metrics (waiting includes requests whose
grammar is compiling), and the scheduler itself, which runs ``KVManager.check_integrity()`` on
every idle pass: a failed check kills it, and then the requests after the soak fail and the
server's exit code is not 0."""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
from collections import Counter
from dataclasses import dataclass, field

import aiohttp
import grpc
import pytest

from tests.support import Server
from shared.proto.banyan.v1 import generation_pb2 as pb
from shared.proto.banyan.v1 import generation_pb2_grpc as pb_grpc

REQUESTS = 2000
CONCURRENCY = 32
GIVE_UP = 0.2  # share of clients that cancel, time out, abort or disconnect
POOL = 1600  # KV tokens: the cache evicts all the time, and requests are retracted now and then
VOCAB_LOW, VOCAB_HIGH = 5, 1990  # demo vocabulary without its special tokens (ids 0..4)
CHOICES = ["yes", "no", "maybe not"]
REGEX = r"[a-z]{1,8}"
SCHEMA = json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                     "additionalProperties": False})


@pytest.fixture(scope="module")
def server(demo_dir, tmp_path_factory):
    # One torch thread: the host's cores are shared with the tokenizers, the scheduler and this
    # client, and torch's spinning OpenMP threads slow down ~15x when they do not get a core each.
    s = Server(None, tmp_path_factory.mktemp("soak") / "server.log", "--num-tokenizers", "2",
               "--max-total-tokens", str(POOL), "--max-running-requests", "32", env={"OMP_NUM_THREADS": "1"})
    yield s
    assert s.stop() == 0, s.log_text()[-3000:]


def load(stub) -> pb.GetLoadResponse:
    return stub.GetLoad(pb.GetLoadRequest())


def idle_and_whole(l: pb.GetLoadResponse) -> bool:
    return (l.num_running_requests, l.num_waiting_requests) == (0, 0) and \
        l.kv_free_tokens + l.kv_evictable_tokens == l.kv_pool_tokens


def wait_idle(stub, timeout: float = 30.0) -> pb.GetLoadResponse:
    deadline = time.monotonic() + timeout
    while not idle_and_whole(l := load(stub)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return l


def scheduler_gauge(server: Server, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} (\S+)$", server.metrics("scheduler"), re.M)
    assert m, name
    return float(m.group(1))


# ---- the soak ----------------------------------------------------------------------------------
@dataclass
class Spec:
    rid: str
    prompt: list[int]
    max_tokens: int
    n: int = 1
    constraint: str = ""  # "" | choice | regex | json
    give_up: str = ""  # "" | cancel_early | cancel_mid | deadline | abort_rpc | disconnect (HTTP)
    after: int = 0  # responses to read before giving up
    http: bool = False
    temperature: float = 0.8


@dataclass
class Tally:
    outcomes: Counter = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)


def make_specs(rng: random.Random) -> list[Spec]:
    """Mostly short prompts (half of them behind a shared prefix) and outputs, so that 2000 fit a
    CI minute; one in twenty prompts is long, one in thirty outputs. Clients who give up ask for
    long outputs."""
    prefixes = [[rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(k)] for k in (8, 24, 64, 128)]
    specs = []
    for i in range(REQUESTS):
        suffix = [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(rng.randrange(1, 9))]
        if rng.random() < 0.05:
            suffix += [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(rng.randrange(100, 300))]
        prompt = (rng.choice(prefixes) if rng.random() < 0.5 else []) + suffix
        s = Spec(rid=f"soak-{i}", prompt=prompt, max_tokens=rng.choice((1, 2, 3, 4, 6, 8)),
                 n=rng.choices((1, 2, 3), (0.8, 0.12, 0.08))[0], temperature=rng.choice((0.0, 0.8)))
        if rng.random() < 0.1:
            s.constraint = rng.choice(("choice", "regex", "json"))
            s.max_tokens = 16
        elif rng.random() < 0.03:  # long outputs outgrow what admission reserved for them: retractions
            s.max_tokens = rng.randrange(96, 160)
        s.http = rng.random() < 0.15
        if rng.random() < GIVE_UP:
            s.give_up = "disconnect" if s.http else rng.choice(("cancel_early", "cancel_mid", "deadline", "abort_rpc"))
            s.after = rng.randrange(0, 3)
            s.max_tokens = 64
        specs.append(s)
    return specs


def grpc_request(s: Spec) -> pb.GenerateRequest:
    req = pb.GenerateRequest(request_id=s.rid, token_ids=pb.TokenIds(ids=s.prompt), sampling_params=pb.SamplingParams(
        max_tokens=s.max_tokens, n=s.n, temperature=s.temperature, ignore_eos=not s.constraint))
    if s.constraint == "choice":
        req.choice.choices.extend(CHOICES)
    elif s.constraint == "regex":
        req.regex = REGEX
    elif s.constraint == "json":
        req.json_schema = SCHEMA
    return req


def check_complete(s: Spec, texts: dict[int, str], finishes: dict[int, str], tally: Tally,
                   counts: dict[int, tuple[int, int]] | None = None) -> None:
    """A request nobody gave up on: every branch ended with a reason, its usage matches the tokens
    streamed (``counts``: index → (usage, tokens); gRPC only), its text obeys the constraint."""
    if sorted(finishes) != list(range(s.n)):
        tally.problems.append(f"{s.rid}: branches finished {sorted(finishes)} of n={s.n}")
        return
    for i in range(s.n):
        if counts is not None and (counts[i][0] != counts[i][1] or counts[i][0] > s.max_tokens):
            tally.problems.append(f"{s.rid}[{i}]: usage {counts[i][0]}, {counts[i][1]} tokens streamed")
        t, finish = texts.get(i, ""), finishes[i]
        if finish not in ("stop", "length"):
            tally.problems.append(f"{s.rid}[{i}]: finished {finish}")
        elif finish == "stop" and s.constraint == "choice" and t not in CHOICES:
            tally.problems.append(f"{s.rid}[{i}]: {t!r} is not a choice")
        elif finish == "stop" and s.constraint == "regex" and not re.fullmatch(REGEX, t):
            tally.problems.append(f"{s.rid}[{i}]: {t!r} does not match {REGEX}")
        elif finish == "stop" and s.constraint == "json" and not isinstance(json.loads(t).get("ok"), bool):
            tally.problems.append(f"{s.rid}[{i}]: {t!r} is not the schema's JSON")
    tally.outcomes["completed"] += 1


FINISH = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_ABORT: "abort"}


async def run_grpc(stub: pb_grpc.GenerationServiceStub, s: Spec, tally: Tally, rng: random.Random) -> None:
    timeout = rng.uniform(0.02, 0.3) if s.give_up == "deadline" else 120
    call = stub.Generate(grpc_request(s), timeout=timeout)
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    tokens: dict[int, int] = {}
    usage: dict[int, int] = {}
    seen = 0
    try:
        if s.give_up == "cancel_early":
            await asyncio.sleep(rng.uniform(0, 0.05))
            call.cancel()
        async for r in call:
            texts[r.index] = texts.get(r.index, "") + r.text
            tokens[r.index] = tokens.get(r.index, 0) + len(r.token_ids)
            if r.finish_reason:
                finishes[r.index], usage[r.index] = FINISH[r.finish_reason], r.usage.completion_tokens
            seen += 1
            if seen > s.after and s.give_up == "cancel_mid":
                call.cancel()
            elif seen > s.after and s.give_up == "abort_rpc":
                await stub.Abort(pb.AbortRequest(request_id=s.rid))
                s.give_up = "aborted"
    except grpc.aio.AioRpcError as e:
        expected = {"cancel_early": grpc.StatusCode.CANCELLED, "cancel_mid": grpc.StatusCode.CANCELLED,
                    "deadline": grpc.StatusCode.DEADLINE_EXCEEDED}.get(s.give_up)
        if e.code() != expected:
            tally.problems.append(f"{s.rid} ({s.give_up or 'normal'}): {e.code()} {e.details()}")
        tally.outcomes[s.give_up] += 1
        return
    except asyncio.CancelledError:  # grpc.aio's cancel() ends the iteration this way
        if s.give_up not in ("cancel_early", "cancel_mid"):
            raise
        tally.outcomes[s.give_up] += 1
        return
    if s.give_up == "aborted":
        if sorted(finishes) != list(range(s.n)):
            tally.problems.append(f"{s.rid}: aborted, but branches finished {sorted(finishes)} of n={s.n}")
        tally.outcomes["abort_rpc"] += 1
    elif s.give_up:  # it finished before the client gave up (short outputs, generous deadlines)
        tally.outcomes[f"{s.give_up}_too_late"] += 1
    else:
        check_complete(s, texts, finishes, tally, {i: (usage.get(i, -1), tokens.get(i, 0)) for i in range(s.n)})


async def run_http(session: aiohttp.ClientSession, url: str, s: Spec, tally: Tally) -> None:
    body = {"prompt": s.prompt, "max_tokens": s.max_tokens, "n": s.n, "temperature": s.temperature,
            "ignore_eos": not s.constraint, "stream": bool(s.give_up)}
    if s.constraint == "choice":
        body["choice"] = CHOICES
    elif s.constraint == "regex":
        body["regex"] = REGEX
    elif s.constraint == "json":
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "x", "schema": json.loads(SCHEMA)}}
    async with session.post(f"{url}/v1/completions", json=body, headers={"X-Request-Id": s.rid}) as resp:
        if resp.status != 200:
            tally.problems.append(f"{s.rid} (http): {resp.status} {(await resp.text())[:300]}")
            return
        if s.give_up:  # read a few events, then hang up
            for _ in range(s.after + 1):
                if not await resp.content.readline():
                    break
            resp.close()
            tally.outcomes["disconnect"] += 1
            return
        out = await resp.json()
    if out["usage"]["completion_tokens"] > s.n * s.max_tokens:
        tally.problems.append(f"{s.rid} (http): usage {out['usage']}")
    check_complete(s, {c["index"]: c["text"] for c in out["choices"]},
                   {c["index"]: c["finish_reason"] for c in out["choices"]}, tally)


async def soak(server: Server, specs: list[Spec], seed: int) -> Tally:
    tally = Tally()
    rng = random.Random(seed)
    queue: asyncio.Queue[Spec] = asyncio.Queue()
    for s in specs:
        queue.put_nowait(s)
    opts = [("grpc.use_local_subchannel_pool", 1)]  # own connections: the kernel spreads them over replicas
    channels = [grpc.aio.insecure_channel(server.target, options=opts) for _ in range(4)]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        async def client(k: int) -> None:
            stub = pb_grpc.GenerationServiceStub(channels[k % len(channels)])
            while not queue.empty():
                s = queue.get_nowait()
                try:
                    if s.http:
                        await run_http(session, server.http_url, s, tally)
                    else:
                        await run_grpc(stub, s, tally, rng)
                except Exception as e:  # noqa: BLE001 - recorded, the soak goes on
                    tally.problems.append(f"{s.rid}: {type(e).__name__}: {e}")

        await asyncio.gather(*(client(k) for k in range(CONCURRENCY)))
    for ch in channels:
        await ch.close()
    return tally


def test_soak_with_clients_giving_up(server, stub):
    specs = make_specs(random.Random(1234))
    start = time.monotonic()
    tally = asyncio.run(soak(server, specs, seed=99))
    elapsed = time.monotonic() - start
    print(f"soak: {REQUESTS} requests in {elapsed:.1f} s, {dict(tally.outcomes)}")
    assert not tally.problems, tally.problems[:20]
    assert sum(tally.outcomes.values()) == REQUESTS
    gave_up = sum(v for k, v in tally.outcomes.items() if k != "completed" and not k.endswith("_too_late"))
    assert gave_up >= REQUESTS * GIVE_UP * 0.5, tally.outcomes  # the clients did give up, mostly in flight

    after = wait_idle(stub)
    print(f"soak: {after.retractions} retractions, {after.evicted_tokens} cached tokens evicted")
    assert idle_and_whole(after), after
    assert after.evicted_tokens > 0, "the pool was meant to be small enough to evict cached prefixes"
    time.sleep(0.5)  # idle passes of the scheduler, each of which runs check_integrity
    assert server.proc.poll() is None
    assert scheduler_gauge(server, "banyan:num_running_requests") == 0
    assert scheduler_gauge(server, "banyan:num_waiting_requests") == 0  # grammars compiling included
    assert scheduler_gauge(server, "banyan:kv_cache_usage") == 0
    errors = [r for r in server.log_records() if r.get("level") == "error"]
    assert not errors, errors[:5]
    # no request id is left behind in the scheduler: the ones given up on are free to use again
    reused = [s for s in specs if s.give_up and not s.http][:20]
    for s in reused:
        out = list(stub.Generate(pb.GenerateRequest(request_id=s.rid, token_ids=pb.TokenIds(ids=s.prompt),
                                                    sampling_params=pb.SamplingParams(max_tokens=2, ignore_eos=True)),
                                 timeout=60))
        assert out[-1].usage.completion_tokens == 2
    assert idle_and_whole(wait_idle(stub))


# ---- deadlines ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def two_lanes(demo_dir, tmp_path_factory):
    """Two running slots: two long requests hold them, and a third waits in the queue."""
    s = Server(None, tmp_path_factory.mktemp("deadline") / "server.log", "--max-running-requests", "2",
               env={"OMP_NUM_THREADS": "1"})
    yield s
    assert s.stop() == 0, s.log_text()[-3000:]


def _finished(server: Server, rid: str) -> list[dict]:
    return [r for r in server.log_records() if r.get("request_id") == rid and r.get("service") == "scheduler"
            and r.get("stage") == "finished"]


def _long(rid: str, text: str = "a long request") -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id=rid, text=text,
                              sampling_params=pb.SamplingParams(max_tokens=3000, ignore_eos=True))


@pytest.mark.parametrize("where", ["running", "queued"])
def test_deadline_aborts_in_the_scheduler(two_lanes, where):
    """A gRPC deadline ends the call with DEADLINE_EXCEEDED and aborts the request in the
    scheduler: its "finished" stage line says abort, its KV is back, nothing runs or waits.
    ``running``: it is decoding when the deadline passes (3000 tokens take far longer than 1 s);
    ``queued``: it waits behind two long requests holding both running slots."""
    server = two_lanes
    with server.channel() as ch:
        stub = pb_grpc.GenerationServiceStub(ch)
        assert idle_and_whole(wait_idle(stub))
        rid = f"deadline-{where}"
        blockers = [stub.Generate(_long(f"blocker-{where}-{i}"), timeout=120) for i in range(2 if where == "queued" else 0)]
        try:
            for b in blockers:
                next(b)  # running
            got = 0
            with pytest.raises(grpc.RpcError) as e:
                for r in stub.Generate(_long(rid, "a request with a deadline"), timeout=1.0):
                    got += len(r.token_ids)
            assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert (got > 0) == (where == "running"), got
            deadline = time.monotonic() + 10
            while not (done := _finished(server, rid)) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert [r["finish_reason"] for r in done] == ["abort"], done
            assert 0 < done[0]["completion_tokens"] < 3000 if where == "running" else done[0]["completion_tokens"] == 0
            if where == "queued":  # it left the queue while both blockers still run
                l = load(stub)
                assert (l.num_running_requests, l.num_waiting_requests) == (2, 0), l
        finally:
            for b in blockers:
                b.cancel()
        after = wait_idle(stub)
        assert idle_and_whole(after), after
    cancelled = [r for r in server.log_records() if r.get("request_id") == rid and r.get("stage") == "cancelled"]
    assert [r["service"] for r in cancelled] == ["tokenizer"], cancelled
