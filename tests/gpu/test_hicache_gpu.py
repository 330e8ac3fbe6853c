"""The hierarchical cache's GPU path (skipped without CUDA): copies on the copy stream through a
staging buffer smaller than one op (chunks), one DMA per run of host slots; a demote is complete
before the next forward writes its freed slots, and that forward waits for it alone (not for the backups
queued before it); a load is waited for by the batch that lists it;
and end to end, greedy outputs with the host tier equal those without it on a capped pool.

    python -m pytest -q -m gpu tests/gpu/test_hicache_gpu.py
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest
import torch

from benchmarks.gpu.make_model import build
from services.worker import host_pool
from services.worker.host_pool import HostPool, TierCopier
from services.worker.kv_pool import KVPool
from shared.messages.common import i32
from shared.messages.to_worker import CacheOp, CacheOps, CopyKind

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def op(op_id, kind, device, host) -> CacheOp:
    return CacheOp(op_id=op_id, kind=kind, device=i32(list(device)), host=i32(list(host)))


def until_done(c: TierCopier, ids: set[int]) -> dict[int, float]:
    got: dict[int, float] = {}
    deadline = time.monotonic() + 30
    while set(got) != ids and time.monotonic() < deadline:
        done, failed = c.poll()
        assert not failed, failed
        got.update(done)
    return got


@pytest.fixture()
def copier(monkeypatch) -> TierCopier:
    monkeypatch.setattr(host_pool, "STAGING_BYTES", 100 * 2 * 4 * 8 * 128 * 2)  # 100 tokens a chunk
    monkeypatch.setattr(host_pool, "DEMOTE_STAGING_BYTES", 100 * 2 * 4 * 8 * 128 * 2)
    pool = KVPool(4, 4097, 8, 128, torch.bfloat16, "cuda")
    pool.buf.normal_()
    return TierCopier(pool, HostPool(3000, pool.bytes_per_token, pin=True), None)


def test_backup_and_load_round_trip_in_chunks(copier) -> None:
    pool = copier.kv
    rng = random.Random(0)
    dev = rng.sample(range(1, 4097), 700)  # scattered pool slots …
    host = list(range(10, 260)) + list(range(1000, 1450))  # … into two runs of host slots (7 chunks)
    want = pool.tokens()[torch.tensor(dev, device="cuda")].cpu()
    copier.submit(CacheOps([op(1, CopyKind.BACKUP, dev, host)]))
    secs = until_done(copier, {1})
    assert secs[1] > 0
    assert torch.equal(copier.host.data[torch.tensor(host)].view(want.shape), want)
    back = rng.sample(sorted(set(range(1, 4097)) - set(dev)), 700)
    copier.submit(CacheOps([op(2, CopyKind.LOAD, back, host)]))
    until_done(copier, {2})
    copier.before_forward(i32([2]))
    assert torch.equal(pool.tokens()[torch.tensor(back, device="cuda")].cpu(), want)


def test_the_next_forward_waits_for_a_demote(copier) -> None:
    pool = copier.kv
    dev = list(range(100, 1100))
    want = pool.tokens()[100:1100].cpu()
    torch.cuda._sleep(50_000_000)  # the compute stream is busy: the copy (after it) cannot have run yet
    copier.submit(CacheOps([op(3, CopyKind.DEMOTE, dev, range(1, 1001))]))
    copier.before_forward(b"")
    pool.buf[:, :, 100:1100] = 0  # what the next step's writes to the freed slots would do
    torch.cuda.synchronize()
    until_done(copier, {3})
    assert torch.equal(copier.host.data[1:1001].view(want.shape), want)


def test_a_demote_does_not_wait_for_the_backups_queued_before_it(copier) -> None:
    pool = copier.kv
    want = pool.tokens()[100:300].cpu()
    with torch.cuda.stream(copier.stream):
        torch.cuda._sleep(2_000_000_000)  # (~1 s: a long queue of backups on the copy stream)
    copier.submit(CacheOps([op(4, CopyKind.DEMOTE, range(100, 300), range(1, 201))]))
    copier.before_forward(b"")
    mark = torch.cuda.Event()
    mark.record()  # (the next forward: after the demote)
    t0 = time.monotonic()
    mark.synchronize()
    assert time.monotonic() - t0 < 0.5 and not copier.stream.query()  # (the backups' queue still runs)
    until_done(copier, {4})
    assert torch.equal(copier.host.data[1:201].view(want.shape), want)
    torch.cuda.synchronize()


def test_host_tier_outputs_equal_the_gpu_tier_alone(tmp_path: Path) -> None:
    from tests.support import Server
    from shared.proto.banyan.v1 import generation_pb2 as pb
    from shared.proto.banyan.v1 import generation_pb2_grpc as pb_grpc

    from benchmarks.gpu.suite import TOKENIZERS

    tokenizer = next((t for t in TOKENIZERS if (t / "tokenizer.json").exists()), None)
    if tokenizer is None:  # (a server needs a tokenizer even for token-id requests)
        pytest.skip("no Llama 3 tokenizer in .assets/llama3 or the team folder")
    model = build(tmp_path / "m", tokenizer, hidden_size=1024, intermediate_size=2816, num_attention_heads=8,
                  num_key_value_heads=2, head_dim=128, num_hidden_layers=4)
    # The same prompts on a pool that holds them all (every prefix from the GPU tier) and on a capped
    # pool with the host tier (prefixes loaded back from the host): the same prefix lengths, the same
    # computation, so the same bits. (Against a capped pool *without* the tier, which recomputes the
    # evicted history in one longer prefill, bf16 rounds differently and greedy tokens may differ.)
    outs, loads = [], []
    for i, flags in enumerate((("--max-total-tokens", "20000"), ("--max-total-tokens", "3000", "--hicache-ratio", "4"))):
        s = Server(str(model), tmp_path / f"s{i}.log", "--http-port", "-1", *flags)
        try:
            rng, got = random.Random(1), []
            hist = [[rng.randrange(100, 31000) for _ in range(900)] for _ in range(4)]
            with s.channel() as ch:
                stub = pb_grpc.GenerationServiceStub(ch)
                for _ in range(3):
                    for c in range(4):
                        req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=hist[c]), sampling_params=pb.SamplingParams(
                            max_tokens=16, temperature=0.0, ignore_eos=True))
                        out = [t for r in stub.Generate(req, timeout=120) for t in r.token_ids]
                        got.append(out)
                        hist[c] += out + [rng.randrange(100, 31000) for _ in range(50)]
                loads.append(stub.GetLoad(pb.GetLoadRequest()))
            outs.append(got)
        finally:
            assert s.stop() == 0
    assert loads[0].host_cached_tokens == 0 and loads[1].host_cached_tokens > 0
    assert loads[0].prefill_cached_tokens == loads[1].prefill_cached_tokens  # (every prefix found, in either tier)
    assert outs[0] == outs[1]
