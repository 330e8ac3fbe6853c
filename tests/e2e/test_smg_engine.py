"""SMG's engine API of one ``banyan serve`` (demo model), called directly over gRPC as the gateway
calls it — on its own port (``--smg-grpc-port 0``) — and its KV-cache events: a subscriber of
``SubscribeKvEvents`` and one of the ZMQ socket (``--kv-events-endpoint``) rebuild, from events
alone, exactly the scheduler's radix tree after a soak with evictions (stored minus removed blocks
= the tree's pages; a fresh subscriber's snapshot, walked from the tree, agrees); FlushCache;
Generate (streaming, n, stop strings ending the request on the engine, Abort) and its refusals;
GetTokenizer's files; the fleet gauges of the Inference Extension's model-server protocol."""

from __future__ import annotations

import hashlib
import io
import json
import random
import threading
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import msgspec
import pytest
import requests
import zmq
from smg_grpc_proto.generated import common_pb2 as common
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from shared.proto.banyan.v1 import generation_pb2 as bpb
from shared.proto.banyan.v1 import generation_pb2_grpc as bpb_grpc
from tests.support import Server

PAGE = 16


@pytest.fixture(scope="module")
def server(demo_dir, tmp_path_factory):
    s = Server(None, tmp_path_factory.mktemp("smg-engine") / "server.log", "--page-size", str(PAGE),
               "--max-total-tokens", "2048", "--max-running-requests", "4", "--smg-grpc-port", "0",
               "--kv-events-endpoint", "tcp://127.0.0.1:*", "--kv-events-topic", "kv@banyan")
    yield s
    assert s.stop() == 0, s.log_text()[-3000:]


def _logged(server: Server, event: str) -> dict:
    return next(r for r in server.log_records() if r.get("event") == event)


@pytest.fixture(scope="module")
def stub(server):
    port = _logged(server, "serving")["smg_grpc_port"]
    assert port not in (-1, server.port)
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        yield pb_grpc.SglangSchedulerStub(ch)


def sampling(**kw) -> pb.SamplingParams:
    return pb.SamplingParams(**{"temperature": 0.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0,
                                "skip_special_tokens": True, "n": 1, **kw})


def generate(stub, ids, rid="", stream=False, **kw) -> list[pb.GenerateResponse]:
    req = pb.GenerateRequest(request_id=rid, tokenized=pb.TokenizedInput(input_ids=ids), stream=stream,
                             logprob_start_len=-1, sampling_params=sampling(**kw))
    return list(stub.Generate(req, timeout=120))


def ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 1900) for _ in range(n)]


def test_the_service_on_its_own_port(server, stub):
    info = stub.GetModelInfo(pb.GetModelInfoRequest())
    assert (info.served_model_name, info.max_context_length, info.vocab_size, info.is_generation) == \
        ("banyan-demo", 4096, 2000, True)
    assert list(info.eos_token_ids) and info.architectures == ["LlamaForCausalLM"] and info.model_type == "llama"
    si = stub.GetServerInfo(pb.GetServerInfoRequest())
    with grpc.insecure_channel(server.target) as ch:
        pool = bpb_grpc.GenerationServiceStub(ch).GetModelInfo(bpb.GetModelInfoRequest()).kv_pool_tokens
    assert si.server_type == "grpc" and si.max_total_num_tokens == pool
    assert si.scheduler_info["max_running_requests"] == 4
    assert stub.HealthCheck(pb.HealthCheckRequest()).healthy
    loads = stub.GetLoads(pb.GetLoadsRequest(include=["core", "memory"]))
    (load,) = loads.loads
    assert loads.dp_rank_count == 1 and load.max_total_num_tokens == load.memory.token_capacity == pool
    assert not load.HasField("queues") and 0 <= load.token_usage <= 1
    with pytest.raises(grpc.RpcError) as e:
        stub.GetLoads(pb.GetLoadsRequest(include=["gpu"]))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "include" in e.value.details()
    with grpc.insecure_channel(server.target) as ch:  # not beside banyan.v1 on the main port
        with pytest.raises(grpc.RpcError) as e:
            pb_grpc.SglangSchedulerStub(ch).GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_generate_streams_and_stops_on_the_engine(server, stub):
    prompt = ids(1, 20)
    whole = generate(stub, prompt, max_new_tokens=24, ignore_eos=True)
    (done,) = [r.complete for r in whole]
    assert done.finish_reason == "length" and len(done.output_ids) == 24 and done.prompt_tokens == 20
    streamed = generate(stub, prompt, stream=True, max_new_tokens=24, ignore_eos=True, n=2)
    for i in (0, 1):
        chunks = [r.chunk for r in streamed if r.HasField("chunk") and r.chunk.index == i]
        (end,) = [r.complete for r in streamed if r.HasField("complete") and r.complete.index == i]
        assert [t for c in chunks for t in c.token_ids] == list(done.output_ids)  # greedy: the same ids
        assert chunks[-1].completion_tokens == 24 and end.completion_tokens == 24 and end.cached_tokens >= 16
    out = list(done.output_ids)
    stop_id = out[10]
    cut = generate(stub, prompt, max_new_tokens=24, ignore_eos=True, stop_token_ids=[stop_id]).pop().complete
    assert cut.finish_reason == "stop" and cut.matched_token_id == stop_id
    assert list(cut.output_ids) == out[:out.index(stop_id) + 1]
    # a stop string: Banyan matches it in its own detokenized text and stops generating there
    text = requests.post(server.http_url + "/detokenize", json={"tokens": out}, timeout=30).json()["prompt"]
    head = requests.post(server.http_url + "/detokenize", json={"tokens": out[:12]}, timeout=30).json()["prompt"]
    stop = next(text[i:i + 3] for i in range(len(head) - 3, 0, -1)
                if "\ufffd" not in text[i:i + 3] and text.index(text[i:i + 3]) == i)
    cut = generate(stub, prompt, max_new_tokens=24, ignore_eos=True, stop=[stop]).pop().complete
    assert cut.finish_reason == "stop" and cut.matched_stop_str == stop
    # (the stop string ends within the first 12 tokens' text; the detokenizer may hold a character back)
    assert cut.completion_tokens < 24 and list(cut.output_ids) == out[:len(cut.output_ids)]


def test_refusals_name_the_field(stub):
    cases = [(dict(max_new_tokens=4, repetition_penalty=3.0), "sampling_params.repetition_penalty"),
             (dict(max_new_tokens=4, top_p=0.0), "sampling_params.top_p"),
             (dict(max_new_tokens=2, min_new_tokens=3), "sampling_params.min_new_tokens"),
             (dict(max_new_tokens=2, logit_bias={"2000": 1.0}), "sampling_params.logit_bias"),
             (dict(max_new_tokens=4, structural_tag="{}"), "sampling_params.structural_tag"),
             (dict(max_new_tokens=4, regex="("), "regex")]
    for kw, field in cases:
        with pytest.raises(grpc.RpcError) as e:
            generate(stub, ids(2, 8), **kw)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in e.value.details(), (field, e.value)
    with pytest.raises(grpc.RpcError) as e:
        generate(stub, [5, 2000])
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "2000" in e.value.details()
    req = pb.GenerateRequest(tokenized=pb.TokenizedInput(input_ids=[5, 6]), sampling_params=sampling(),
                             logprob_start_len=-1, data_parallel_rank=1)
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(req, timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "data_parallel_rank" in e.value.details()
    for call, msg in ((stub.Embed, pb.EmbedRequest()), (stub.StartProfile, common.StartProfileRequest()),
                      (stub.LoadLoRAAdapter, pb.LoadLoRAAdapterRequest())):
        with pytest.raises(grpc.RpcError) as e:
            call(msg, timeout=10)
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED and "Banyan" in e.value.details()


def test_prompt_logprobs_prefill_only_and_logit_processors(server, stub, demo_dir):
    """return_logprob with logprob_start_len >= 0: the prompt's log-probs (vs HF fp32), on the first
    chunk and the complete message; max_new_tokens 0 prefills only; the logit processors answer as
    on banyan.v1."""
    import torch
    import transformers

    prompt = ids(5, 40)
    hf = transformers.AutoModelForCausalLM.from_pretrained(demo_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        lp = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)

    def check(inp, start: int, top: int) -> None:
        assert list(inp.token_ids) == prompt[start:]
        for pos, v, t in zip(range(start, len(prompt)), inp.token_logprobs, inp.top_logprobs):
            if pos == 0:
                assert not v.HasField("value")
                continue
            assert v.value == pytest.approx(lp[pos - 1, prompt[pos]].item(), abs=1e-4)
            assert list(t.values) == pytest.approx(lp[pos - 1].topk(top).values.tolist(), abs=1e-4)

    def run(start: int, stream: bool, **kw) -> list[pb.GenerateResponse]:
        req = pb.GenerateRequest(tokenized=pb.TokenizedInput(input_ids=prompt), stream=stream, return_logprob=True,
                                 logprob_start_len=start, top_logprobs_num=2, sampling_params=sampling(**kw))
        return list(stub.Generate(req, timeout=120))

    (only,) = run(0, False, max_new_tokens=0)
    assert only.complete.finish_reason == "length" and not only.complete.output_ids
    check(only.complete.input_logprobs, 0, 2)
    streamed = run(25, True, max_new_tokens=3, ignore_eos=True)
    chunks = [r.chunk for r in streamed if r.HasField("chunk")]
    check(chunks[0].input_logprobs, 25, 2)
    assert not any(c.HasField("input_logprobs") for c in chunks[1:])
    check(streamed[-1].complete.input_logprobs, 25, 2)
    assert streamed[-1].complete.cached_tokens >= 16  # (the prefill-only request cached the prompt)
    kw = dict(max_new_tokens=6, ignore_eos=True, repetition_penalty=1.5, min_new_tokens=2, logit_bias={"7": 2.5})
    got = generate(stub, prompt, **kw).pop().complete.output_ids
    with grpc.insecure_channel(server.target) as ch:
        own = bpb_grpc.GenerationServiceStub(ch).Generate(bpb.GenerateRequest(
            token_ids=bpb.TokenIds(ids=prompt), sampling_params=bpb.SamplingParams(
                max_tokens=6, temperature=0.0, ignore_eos=True, repetition_penalty=1.5, min_tokens=2,
                logit_bias={7: 2.5})), timeout=120)
        assert list(got) == [t for r in own for t in r.token_ids]


def test_abort_ends_a_running_request(stub):
    req = pb.GenerateRequest(request_id="to-abort", tokenized=pb.TokenizedInput(input_ids=ids(3, 10)), stream=True,
                             logprob_start_len=-1, sampling_params=sampling(max_new_tokens=2000, ignore_eos=True))
    call = stub.Generate(req, timeout=120)
    first = next(call)
    assert first.chunk.token_ids
    assert stub.Abort(pb.AbortRequest(request_id="to-abort")).success
    rest = list(call)
    assert rest[-1].complete.finish_reason == "abort" and rest[-1].complete.completion_tokens < 2000
    assert not stub.Abort(pb.AbortRequest(request_id="to-abort")).success


def test_get_tokenizer_streams_the_model_files(stub, demo_dir):
    parts = list(stub.GetTokenizer(common.GetTokenizerRequest(), timeout=30))
    data = b"".join(p.data for p in parts)
    assert parts[-1].sha256 == hashlib.sha256(data).hexdigest() and not any(p.sha256 for p in parts[:-1])
    z = zipfile.ZipFile(io.BytesIO(data))
    assert {"tokenizer.json", "tokenizer_config.json", "config.json"} <= set(z.namelist())
    for name in z.namelist():
        assert z.read(name) == (Path(demo_dir) / name).read_bytes()


class Collector:
    """A SubscribeKvEvents subscriber in a thread: the blocks the events say are cached."""

    def __init__(self, stub, start: int = 0) -> None:
        self.blocks: dict[int, tuple[int | None, tuple[int, ...]]] = {}
        self.batches = 0
        self.seqs: list[int] = []
        self.call = stub.SubscribeKvEvents(common.SubscribeKvEventsRequest(start_sequence_number=start))
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            for batch in self.call:
                self.seqs.append(batch.sequence_number)
                for ev in batch.events:
                    kind = ev.WhichOneof("data")
                    if kind == "cleared":
                        self.blocks.clear()
                    elif kind == "stored":
                        parent = ev.stored.parent_block_hash if ev.stored.HasField("parent_block_hash") else None
                        for b in ev.stored.blocks:
                            assert parent is None or parent in self.blocks and b.block_size == PAGE
                            self.blocks[b.block_hash] = (parent, tuple(b.token_ids))
                            parent = b.block_hash
                    else:
                        for h in ev.removed.block_hashes:
                            del self.blocks[h]
                self.batches += 1
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.CANCELLED, e

    def settle(self, timeout: float = 30) -> None:
        """Until no batch arrived for a second."""
        deadline, seen = time.monotonic() + timeout, -1
        while seen != self.batches:
            assert time.monotonic() < deadline
            seen = self.batches
            time.sleep(1.0)

    def close(self) -> None:
        self.call.cancel()
        self.thread.join(10)


class ZmqCollector:
    """A consumer of the PUB socket (vLLM's layout), as llm-d's indexer reads it."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"kv@banyan")
        self.sock.connect(endpoint)
        self.blocks: dict[int, tuple[int, ...]] = {}
        self.seqs: list[int] = []

    def drain(self) -> None:
        while self.sock.poll(500):
            topic, seq, payload = self.sock.recv_multipart()
            self.seqs.append(int.from_bytes(seq, "big"))
            for ev in msgspec.msgpack.decode(payload)[1]:
                if ev[0] == "BlockStored":
                    bs = ev[4]
                    for i, h in enumerate(ev[1]):
                        self.blocks[h] = tuple(ev[3][i * bs:(i + 1) * bs])
                elif ev[0] == "BlockRemoved":
                    for h in ev[1]:  # (a block cached before it subscribed: no replay on this socket)
                        self.blocks.pop(h, None)
                else:
                    self.blocks.clear()

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


def gauge(server: Server, name: str) -> float:
    return next(float(line.split()[-1]) for line in server.metrics("scheduler").splitlines()
                if line.startswith(name + " "))


def test_fleet_gauges(server, stub):
    """The Inference Extension's TotalQueuedRequests and KVCacheUtilization: 8 long requests on 4
    running slots (fewer when their KV does not fit) leave at least 4 in the queue."""
    calls = [stub.Generate(pb.GenerateRequest(
        request_id=f"gauge-{i}", tokenized=pb.TokenizedInput(input_ids=ids(50 + i, 40)), stream=True,
        logprob_start_len=-1, sampling_params=sampling(max_new_tokens=400, ignore_eos=True))) for i in range(8)]
    try:
        deadline = time.monotonic() + 60
        while stub.GetLoads(pb.GetLoadsRequest()).loads[0].num_waiting_reqs < 4:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        while gauge(server, "banyan:num_requests_waiting") < 1:  # (the gauges follow a step later)
            assert time.monotonic() < deadline
        assert gauge(server, "banyan:num_requests_waiting") <= 8
        assert 0 < gauge(server, "banyan:kv_cache_usage_perc") <= 1
    finally:
        for c in calls:
            c.cancel()
    idle(stub)
    deadline = time.monotonic() + 30
    while gauge(server, "banyan:num_requests_waiting") or gauge(server, "banyan:kv_cache_usage_perc"):
        assert time.monotonic() < deadline, "the gauges never went back to 0"
        time.sleep(0.1)


def idle(stub) -> pb.SchedulerLoad:
    for _ in range(300):
        (load,) = stub.GetLoads(pb.GetLoadsRequest()).loads
        if load.num_running_reqs == load.num_waiting_reqs == 0:
            return load
        time.sleep(0.1)
    raise AssertionError(f"never idle: {load}")


def test_kv_events_rebuild_the_tree_after_a_soak_with_evictions(server, stub):
    zmq_sub = ZmqCollector(_logged(server, "kv_events_publishing")["endpoint"])
    first = Collector(stub, start=100)
    time.sleep(1.0)  # (both subscriptions take hold)
    idle(stub)
    assert stub.FlushCache(common.FlushCacheRequest()).success  # what the socket's subscriber missed goes
    families = [ids(10 + f, 96) for f in range(8)]  # 8 × 96 prefix tokens against a 2048-token pool

    def one(i: int) -> None:
        prompt = families[i % len(families)] + ids(1000 + i, 5 + i % 40)
        generate(stub, prompt, rid=f"soak-{i}", max_new_tokens=8 + i % 9, ignore_eos=True)

    with ThreadPoolExecutor(6) as pool:
        list(pool.map(one, range(72)))
    idle(stub)
    first.settle()
    zmq_sub.drain()
    with grpc.insecure_channel(server.target) as ch:
        load = bpb_grpc.GenerationServiceStub(ch).GetLoad(bpb.GetLoadRequest())
    assert load.evicted_tokens > 0, "the soak must evict"
    assert first.seqs[0] == 101 and first.seqs == list(range(101, 101 + len(first.seqs)))
    # stored minus removed = the tree's pages (idle: every cached page is evictable, one block each)
    assert len(first.blocks) * PAGE == load.kv_evictable_tokens > 0, (len(first.blocks), load)
    assert set(zmq_sub.blocks) == {h & (2**64 - 1) for h in first.blocks}
    assert zmq_sub.seqs == list(range(zmq_sub.seqs[0], zmq_sub.seqs[0] + len(zmq_sub.seqs)))
    first.close()
    time.sleep(0.5)
    fresh = Collector(stub)  # the replica resubscribes: the scheduler walks its tree for the snapshot
    fresh.settle()
    assert fresh.blocks == first.blocks and fresh.seqs[0] == 1
    assert stub.FlushCache(common.FlushCacheRequest()).success
    fresh.settle()
    zmq_sub.drain()
    assert fresh.blocks == {} and zmq_sub.blocks == {}
    fresh.close()
    zmq_sub.close()


def test_structural_tag_is_the_gateways_tool_call_grammar(server, stub):
    """The gateway forces a tool call with a structural tag (xgrammar's format; SGLang's older one is
    converted to it: tests/tokenizer/test_smg_convert.py): the output is that call, with arguments
    that follow the schema."""
    schema = {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"]}
    begin, end = '<tool_call>\n{"name": "get_time", "arguments": ', "}\n</tool_call>"
    call = {"type": "tag", "begin": begin, "end": end,
            "content": {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": 1}}
    tag = {"type": "structural_tag", "format": {"type": "tags_with_separator", "tags": [call], "separator": "\n",
                                                "at_least_one": True, "stop_after_first": True}}
    out = generate(stub, ids(3, 8), max_new_tokens=64, structural_tag=json.dumps(tag)).pop().complete
    text = requests.post(server.http_url + "/detokenize", json={"tokens": list(out.output_ids)},
                         timeout=30).json()["prompt"]
    assert out.finish_reason == "stop" and text.startswith(begin) and text.endswith(end), text
    assert json.loads(text[len(begin):-len(end)])["tz"] in ("UTC", "CET")
