"""The hierarchical KV cache end to end: a multi-turn workload on a KV pool too small for it, served
with the cache tiers off, with a host tier (write-through; write-back with injected copy
failures), and with a disk tier across a restart whose directory holds a corrupt, a truncated and
a foreign file. Greedy outputs are identical whatever tier the KV came from; the counters show it
came from there; failures are counted and their tokens recomputed; the pool ends whole."""

from __future__ import annotations

import random
import subprocess
import sys
import time
import zlib
from pathlib import Path

import msgspec
import pytest

from tests.support import ROOT, Server, make_tiny_model
from services.worker.disk_store import MAGIC, PREFIX, DiskHeader
from shared.proto.banyan.v1 import generation_pb2 as pb
from shared.proto.banyan.v1 import generation_pb2_grpc as pb_grpc

POOL = ["--max-total-tokens", "600", "--http-port", "-1"]
CONVERSATIONS, TURNS, OPENING, USER, OUT = 4, 3, 150, 20, 8


@pytest.fixture(scope="module")
def model_dir(demo_dir, tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("llama-hicache")
    make_tiny_model("llama", d, demo_dir, seed=5, max_positions=2048)
    return str(d)


def conversations(stub) -> tuple[list[list[int]], list[pb.GenerateResponse]]:
    """Each conversation's turns in order (every one a prompt of its whole history, sent when the
    previous answer is back), the conversations interleaved: each turn finds its history evicted
    from the 600-token pool by the others'. → (outputs per request, last response of each)."""
    rng = random.Random(1)
    history = [[rng.randrange(10, 1900) for _ in range(OPENING)] for _ in range(CONVERSATIONS)]
    outs, finals = [], []
    for _ in range(TURNS):
        for c in range(CONVERSATIONS):
            req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=history[c]), sampling_params=pb.SamplingParams(
                max_tokens=OUT, temperature=0.0, ignore_eos=True))
            resps = list(stub.Generate(req, timeout=120))
            out = [t for r in resps for t in r.token_ids]
            outs.append(out)
            finals.append(resps[-1])
            history[c] = history[c] + out + [rng.randrange(10, 1900) for _ in range(USER)]
    return outs, finals


def run(server: Server, settle_s: float = 0.0) -> tuple[list[list[int]], pb.GetLoadResponse]:
    """``settle_s``: how long the tier copies still in flight after the last answer may take to be
    acknowledged (their locks hold pool slots until then)."""
    with server.channel() as ch:
        stub = pb_grpc.GenerationServiceStub(ch)
        outs, _ = conversations(stub)
        deadline = time.monotonic() + settle_s
        load = stub.GetLoad(pb.GetLoadRequest())
        while load.kv_free_tokens + load.kv_evictable_tokens != load.kv_pool_tokens and time.monotonic() < deadline:
            time.sleep(0.05)
            load = stub.GetLoad(pb.GetLoadRequest())
    assert load.num_running_requests == 0 and load.kv_free_tokens + load.kv_evictable_tokens == load.kv_pool_tokens
    return outs, load


def serve(model_dir: str, log: Path, *flags: str, env: dict | None = None) -> Server:
    return Server(model_dir, log, *POOL, *flags, env=env)


@pytest.fixture(scope="module")
def reference(model_dir, tmp_path_factory) -> tuple[list[list[int]], pb.GetLoadResponse]:
    """The cache tiers off: what the evicted history costs (recomputed) and the outputs."""
    s = serve(model_dir, tmp_path_factory.mktemp("off") / "server.log")
    try:
        return run(s)
    finally:
        assert s.stop() == 0, s.log_text()[-3000:]


def metric(text: str, name: str, **labels: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def test_host_tier_serves_evicted_history_with_identical_outputs(model_dir, reference, tmp_path):
    ref_outs, off = reference
    assert off.prefill_cached_tokens == 0 and off.host_pool_tokens == 0  # every turn recomputed its history
    s = serve(model_dir, tmp_path / "server.log", "--hicache-ratio", "4", "--scheduler-metrics-port", "0")
    try:
        outs, on = run(s)
        sched = s.metrics("scheduler")
    finally:
        assert s.stop() == 0, s.log_text()[-3000:]
    assert outs == ref_outs
    assert on.host_pool_tokens == 2400 and on.tier_stored_tokens > 0 and on.tier_loaded_tokens > 0
    turns_after_first = (TURNS - 1) * CONVERSATIONS
    assert on.host_cached_tokens >= turns_after_first * OPENING  # each later turn found its history on the host
    assert on.prefill_computed_tokens < off.prefill_computed_tokens - on.host_cached_tokens // 2
    assert on.tier_failures == 0 and on.disk_cached_tokens == 0
    assert metric(sched, "banyan:cache_hit_rate", tier="host") > 0.5
    assert metric(sched, "banyan:cache_hit_rate", tier="all") == pytest.approx(
        on.prefill_cached_tokens / (on.prefill_cached_tokens + on.prefill_computed_tokens), abs=0.02)
    assert metric(sched, "banyan:hicache_moved_bytes_total", direction="host_to_device") > 0
    assert metric(sched, "banyan:hicache_fetch_wait_seconds_count") >= turns_after_first


def test_a_host_tier_smaller_than_the_pool_with_late_copies(model_dir, reference, tmp_path):
    """W2H's shape on the H200 (a host tier smaller than the pool, so the pool demotes what the full
    host could not back up) with every copy acknowledged 20 polls late, as a GPU's run behind the
    loop, and the scheduler checking its KV books every loop: outputs unchanged, nothing fails."""
    s = serve(model_dir, tmp_path / "server.log", "--hicache-ratio", "0.5",
              env={"BANYAN_HICACHE_FAULTS": "delay:20", "BANYAN_CHECK_INTEGRITY": "1"})
    try:
        outs, on = run(s, settle_s=10)
    finally:
        assert s.stop() == 0, s.log_text()[-3000:]
    assert outs == reference[0]
    assert on.host_pool_tokens == 300 and on.tier_stored_tokens > 0 and on.tier_failures == 0
    assert "Traceback" not in s.log_text()


def test_write_back_with_failing_copies_recomputes_and_loses_nothing(model_dir, reference, tmp_path):
    """Write-back (KV copied to the host only when the pool evicts it) over a disk tier; the 2nd and
    4th loads and the 3rd demote fail, and the disk is full at the 2nd file: those tokens are
    recomputed (or stay on the host), outputs unchanged, the failures counted."""
    s = serve(model_dir, tmp_path / "server.log", "--hicache-ratio", "4", "--hicache-write-policy", "write_back",
              "--hicache-storage-dir", str(tmp_path / "kv"),
              env={"BANYAN_HICACHE_FAULTS": "load:2,load:4,demote:3,disk_write:2"})
    try:
        outs, load = run(s)
        log = s.log_text()
    finally:
        assert s.stop() == 0, s.log_text()[-3000:]
    assert outs == reference[0]
    assert load.tier_failures == 4 and log.count('"hicache_copy_failed"') == 4 and '"disk_full: ' in log
    assert load.tier_stored_tokens > 0 and load.host_cached_tokens > 0 and load.disk_written_tokens > 0


def corrupt(path: Path) -> None:
    """Flip a byte of the KV payload: the header still checks out, the read's checksum does not."""
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def foreign_copy(src: Path, dst: Path) -> None:
    """The same file as another model would have written it (another fingerprint)."""
    raw = src.read_bytes()
    _, hlen, _ = PREFIX.unpack(raw[:PREFIX.size])
    hdr = msgspec.msgpack.decode(raw[PREFIX.size:PREFIX.size + hlen], type=DiskHeader)
    hb = msgspec.msgpack.encode(msgspec.structs.replace(hdr, fingerprint="f" * 64))
    dst.write_bytes(PREFIX.pack(MAGIC, len(hb), zlib.crc32(hb)) + hb + raw[PREFIX.size + hlen:])


def test_disk_tier_survives_a_restart_and_ignores_bad_files(model_dir, reference, tmp_path):
    store = tmp_path / "kv"
    flags = ("--hicache-ratio", "1", "--hicache-storage-dir", str(store))  # a host tier of one pool: most goes to disk
    s = serve(model_dir, tmp_path / "first.log", *flags)
    try:
        outs, first = run(s)
    finally:
        assert s.stop() == 0, s.log_text()[-3000:]
    assert outs == reference[0] and first.disk_written_tokens > 0 and first.disk_cached_tokens > 0
    rank = store / "rank0-of-1"
    files = sorted(rank.glob("*.kv"), key=lambda p: int(p.stem))
    assert len(files) >= 8
    corrupt(files[0])  # (the first conversation's opening: read on its second turn)
    truncated = files[1].read_bytes()
    files[1].write_bytes(truncated[:-7])
    foreign_copy(files[2], rank / "999.kv")
    (rank / "1000.kv.tmp").write_bytes(b"half a write")

    s = serve(model_dir, tmp_path / "second.log", *flags, env={"BANYAN_HICACHE_FAULTS": "disk_read:3"})
    try:
        outs, second = run(s)
        log = s.log_text()
    finally:
        assert s.stop() == 0, s.log_text()[-3000:]
    assert outs == reference[0]
    ignored = [line for line in log.splitlines() if '"kv_file_ignored"' in line]
    assert len(ignored) == 2 and any("truncated" in x for x in ignored) and any("fingerprint" in x for x in ignored)
    assert not (rank / "1000.kv.tmp").exists() and (rank / "999.kv").exists()  # swept; foreign: left alone
    # the corrupt file failed its read (and was deleted), the injected I/O error too: both recomputed
    assert second.tier_failures == 2 and not files[0].exists() and '"corrupt: ' in log
    opening = CONVERSATIONS * OPENING
    assert second.disk_cached_tokens >= opening  # the openings came from the files of the first run
    assert second.prefill_computed_tokens < first.prefill_computed_tokens


def test_disk_tier_flags_are_checked(model_dir, tmp_path):
    for flags, says in ((["--hicache-storage-dir", str(tmp_path)], "--hicache-storage-dir needs the host tier"),
                        (["--hicache-size", "1", "--hicache-ratio", "2"], "give --hicache-size or --hicache-ratio"),
                        (["--hicache-write-policy", "later"], "--hicache-write-policy 'later' is not one of")):
        r = subprocess.run([sys.executable, "-m", "banyan.cli", "serve", "--model", model_dir, *flags], cwd=ROOT,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and says in r.stderr, r.stderr
