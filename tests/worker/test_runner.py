"""The model runner on the CPU, driven by ForwardBatch messages as the scheduler sends them; the
device-independent pieces of the GPU path (page-index gather, graph sizes, fused-draw routing)."""

from __future__ import annotations

from pathlib import Path

import msgspec
import numpy as np
import pytest
import structlog
import torch
from tests.worker.test_models import KVTable, hf_logits, random_seqs, save_tiny_model, tiny_config

from benchmarks.driver import Driver
from services.worker.attention import resolve_backend
from services.worker.attention.flashinfer_backend import kv_indices
from services.worker.cuda_graph import graph_batch_sizes
from services.worker.runner import ModelRunner
from services.worker.sampling.draw import TokenSampler
from shared.config import ConfigError, WorkerConfig
from shared.messages.common import SamplingParams, i32


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp("llama")
    return path, save_tiny_model(tiny_config("llama"), path)


def test_runner_logits_match_hf_through_forward_batches(tiny_llama) -> None:
    path, hf = tiny_llama
    runner = ModelRunner(WorkerConfig(model=str(path), max_total_tokens=512), str(path))
    assert runner.backend == "torch" and runner.graphs is None
    driver = Driver(runner, max_rows=4)
    seqs = random_seqs([11, 7, 5])
    got: list[list[torch.Tensor]] = [[], [], []]
    # step 1: a prompt chunk of 0 and all of 1; step 2: the rest of 0, 1 decodes, 2 arrives whole
    for work in ([("a", seqs[0][:6], False), ("b", seqs[1][:6], True)],
                 [("a", seqs[0][6:10], True), ("b", seqs[1][6:], True), ("c", seqs[2], True)],
                 [("a", seqs[0][10:], True)]):
        logits = runner.forward(driver.batch(work), all_logits=True)
        for part, (rid, _, _) in zip(logits.split([len(t) for _, t, _ in work]), work, strict=True):
            got["abc".index(rid)].append(part)
    for seq, parts in zip(seqs, got, strict=True):
        torch.testing.assert_close(torch.cat(parts), hf_logits(hf, seq), rtol=1e-4, atol=1e-4)


def test_piecewise_steps_match_hf_and_are_counted_by_kind(tiny_llama) -> None:
    """--piecewise-cuda-graph-max-tokens on the CPU: the pieces between attentions run eagerly in place of
    their graphs, through the runner's real path (padded ids, the fixed buffers, between-layer calls)."""
    path, hf = tiny_llama
    runner = ModelRunner(WorkerConfig(model=str(path), max_total_tokens=512, piecewise_cuda_graph_max_tokens=32),
                         str(path))
    assert runner.pieces is not None and runner.pieces.size_for(10) == 16
    calls = []
    runner.between_layers = lambda: calls.append(1)
    driver = Driver(runner, max_rows=4)
    seqs = random_seqs([11, 7, 30])
    got: list[list[torch.Tensor]] = [[], [], []]
    kinds = []
    for work in ([("a", seqs[0][:6], False), ("b", seqs[1][:6], True)],  # prefill (16)
                 [("a", seqs[0][6:10], True), ("b", seqs[1][6:], True)],  # mixed (16)
                 [("a", seqs[0][10:], True), ("c", seqs[2], True)]):  # 31 tokens (32)
        logits = runner.forward(driver.batch(work), all_logits=True)
        kinds.append(runner._kind)
        for part, (rid, _, _) in zip(logits.split([len(t) for _, t, _ in work]), work, strict=True):
            got["abc".index(rid)].append(part)
    assert kinds == ["prefill_piecewise", "mixed_piecewise", "mixed_piecewise"]
    assert len(calls) >= 3 * len(runner.pieces.layers)
    for seq, parts in zip(seqs, got, strict=True):
        torch.testing.assert_close(torch.cat(parts), hf_logits(hf, seq), rtol=1e-4, atol=1e-4)
    runner.forward(driver.batch([("d", random_seqs([40])[0], True)]), all_logits=True)  # 40 tokens: eager
    assert runner._kind == "prefill"


def test_execute_samples_only_flagged_requests(tiny_llama) -> None:
    path, hf = tiny_llama
    runner = ModelRunner(WorkerConfig(model=str(path), max_total_tokens=512), str(path))
    driver = Driver(runner, max_rows=4)
    seqs = random_seqs([9, 4])
    out = driver.run([("a", seqs[0], True), ("b", seqs[1][:2], False)])
    assert out[1] == -1 and out[0] == hf_logits(hf, seqs[0])[-1].argmax().item()
    driver.release("a")
    out = driver.run([("b", seqs[1][2:], True)])
    assert out[0] == hf_logits(hf, seqs[1])[-1].argmax().item()
    assert "a" not in driver.reqs and runner.params.keys() == {driver.reqs["b"].row}


def test_launched_steps_feed_the_tokens_still_on_the_device(tiny_llama) -> None:
    """Overlap: each step is launched before the previous one is finished, its input ids -1 (the
    token the row sampled last, resolved on the device): the same greedy tokens as one step at a
    time with known ids, also with a deferred grammar bitmask (sampled once the mask arrives)."""
    path, _ = tiny_llama
    seqs = random_seqs([9, 5])

    def sequential() -> list[list[int]]:
        driver = Driver(ModelRunner(WorkerConfig(model=str(path), max_total_tokens=512), str(path)), max_rows=4)
        out = driver.run([("a", seqs[0], True), ("b", seqs[1], True)]).tolist()
        toks = [out]
        for _ in range(5):
            toks.append(driver.run([("a", [toks[-1][0]], True), ("b", [toks[-1][1]], True)]).tolist())
        return toks

    runner = ModelRunner(WorkerConfig(model=str(path), max_total_tokens=512), str(path))
    driver = Driver(runner, max_rows=4)
    prev = runner.launch(driver.batch([("a", seqs[0], True), ("b", seqs[1], True)]))
    toks = []
    for i in range(5):
        b = driver.batch([("a", [-1], True), ("b", [-1], True)], follows=True)
        if i == 2:  # a deferred mask that allows everything
            b = msgspec.structs.replace(b, mask_rows=i32([0, 1]), mask_deferred=True)
        launched = runner.launch(b)
        assert launched.awaits_mask == (i == 2)
        if i == 2:
            assert not launched.ready()
        toks.append(runner.finish(prev)[0].tolist())
        if launched.awaits_mask:
            runner.sample(launched, np.full((2, (runner.spec.vocab_size + 31) // 32), -1, np.int32).tobytes())
        prev = launched
    toks.append(runner.finish(prev)[0].tolist())
    assert toks == sequential()
    assert runner.busy_s > 0 and runner.idle_s >= 0


def test_kv_indices_gathers_each_rows_prefix() -> None:
    table = KVTable(num_slots=100, num_rows=5, max_context=16)
    table.batch([(0, 5), (2, 9), (3, 1), (4, 16)])
    rows, lens = torch.tensor([2, 0, 4, 3, 2]), torch.tensor([9, 5, 16, 1, 3])
    got = kv_indices(table.req_to_token, rows, lens, int(lens.sum()))
    want = torch.cat([table.req_to_token[r, :n] for r, n in zip(rows.tolist(), lens.tolist(), strict=True)])
    assert got.dtype == torch.int32 and torch.equal(got, want)


def test_graph_batch_sizes() -> None:
    assert graph_batch_sizes(160) == [1, 2, 4] + list(range(8, 161, 8))
    assert graph_batch_sizes(12) == [1, 2, 4, 8, 12]
    assert graph_batch_sizes(1) == [1]


def test_fused_draw_takes_unseeded_rows_only() -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    calls = []

    def fused(rows: torch.Tensor, params: list[SamplingParams], gen: torch.Generator) -> torch.Tensor:
        calls.append(len(params))
        return torch.full((rows.shape[0],), 49, dtype=torch.int32)

    seeded = SamplingParams(temperature=1.0, seed=5)
    params = [SamplingParams(temperature=0.0), SamplingParams(), seeded, SamplingParams(top_k=3)]
    gens = [None, None, torch.Generator().manual_seed(5), None]
    tokens = TokenSampler(fused=fused).sample(logits, params, gens)
    reference = TokenSampler().sample(logits[2:3], [seeded], [torch.Generator().manual_seed(5)])
    assert calls == [2] and tokens[1] == tokens[3] == 49
    assert tokens[0] == logits[0].argmax() and tokens[2] == reference[0]


def test_backend_choice_and_worker_flags() -> None:
    assert resolve_backend("auto", torch.device("cpu")) == "torch"
    with pytest.raises(ValueError, match="needs a CUDA device"):
        resolve_backend("flashinfer", torch.device("cpu"))
    with pytest.raises(ConfigError, match="attention backend"):
        WorkerConfig(attention_backend="triton")
    with pytest.raises(ConfigError, match="dist_init_addr"):
        WorkerConfig(tp_size=2, tp_rank=1)
    with pytest.raises(ConfigError, match="tp_rank"):
        WorkerConfig(tp_size=2, tp_rank=2, dist_init_addr="127.0.0.1:1")
    with pytest.raises(ConfigError, match="mem_fraction_static"):
        WorkerConfig(mem_fraction_static=1.5)


def test_two_stage_greedy_picks_argmaxs_token() -> None:
    from services.worker.sampling.draw import _chunk_for, greedy

    assert _chunk_for(128256) == 1002 and _chunk_for(151936) == 1187 and _chunk_for(4099) is None  # (4099: prime)
    g = torch.Generator().manual_seed(0)
    for vocab in (128256, 151936, 32000, 4099, 512):
        logits = torch.randn(5, vocab, generator=g)
        logits[1, 7] = logits[1, vocab - 1] = logits[1].max() + 1  # a tie across chunks: the first index
        logits[2, :] = 0.0  # all equal: index 0
        logits[3, vocab // 2] = logits[3, vocab // 2 + 1] = 1e9  # a tie inside a chunk
        want = logits.argmax(-1)
        assert want[1] == 7 and want[2] == 0
        assert torch.equal(greedy(logits, two_stage=True), want), vocab
        assert torch.equal(greedy(logits[:1], two_stage=True), want[:1])


def test_the_step_in_flight_is_answered_while_the_next_is_being_queued(tiny_llama, tmp_path) -> None:
    """Overlap: rank 0's worker answers step N from between the layers of step N+1's (eager)
    launch as soon as N's results are in — not after that launch — and answers each step once."""
    from benchmarks.gpu import step_trace
    from services.worker.metrics import WorkerMetrics
    from services.worker.server import _Steps
    from services.worker.step_trace import StepTrace

    path, hf = tiny_llama
    runner = ModelRunner(WorkerConfig(model=str(path), max_total_tokens=512), str(path))
    driver = Driver(runner, max_rows=4)
    sent, launching = [], []

    class Queue:
        def send(self, msg) -> None:
            sent.append((msg.step_id, bool(launching)))

    launch = runner.launch

    def traced_launch(b):
        launching.append(b.step_id)
        try:
            return launch(b)
        finally:
            launching.pop()

    runner.launch = traced_launch
    metrics = WorkerMetrics()
    steps = _Steps(runner, Queue(), metrics, link=None)
    steps.trace = StepTrace(str(tmp_path / "steps.jsonl"))
    seq = random_seqs([6])[0]
    first = driver.batch([("a", seq, True)])
    steps.run(first)
    assert sent == []  # in flight
    second = driver.batch([("a", [-1], True)], follows=True)  # its input: what the first step samples
    steps.run(second)
    assert sent == [(first.step_id, True)]  # answered from inside the second step's launch
    steps.answer()
    assert sent == [(first.step_id, True), (second.step_id, False)] and steps.inflight is None
    # the host time of both launches; the turnaround only for a step that follows the one before the last
    kind = {"kind": "prefill"}, {"kind": "decode_eager"}
    assert [metrics.registry.get_sample_value("banyan:step_host_seconds_count", k) for k in kind] == [1.0, 1.0]
    assert metrics.registry.get_sample_value("banyan:step_turnaround_seconds_count", kind[1]) is None
    steps.run(driver.batch([("a", [-1], True)], follows=True))  # step N+2, built once N was answered
    assert metrics.registry.get_sample_value("banyan:step_turnaround_seconds_count", kind[1]) == 1.0
    steps.answer()
    steps.trace.close()  # the timeline: a line a step, in order, its host times in order
    trace = step_trace.load(tmp_path / "steps.jsonl")
    assert [t["step"] for t in trace] == [first.step_id, second.step_id, second.step_id + 1]
    assert [t["kind"] for t in trace] == ["prefill", "decode_eager", "decode_eager"]
    assert all(t["recv"] <= t["queued"] <= t["answered"] for t in trace)
    assert trace[2]["turnaround_ms"] == pytest.approx(trace[2]["recv"] - trace[0]["answered"])
    assert "| decode_eager | 2 |" in step_trace.summary(trace, "decode_eager", 3)


def test_cpu_pool_starts_zeroed_without_writing_its_zeros() -> None:
    """The CPU pool is anonymous memory (zeros from the OS, faulted in when written): every byte reads 0,
    each pool is its own memory, and the FP8 pool's view of it works too."""
    from services.worker.kv_pool import KVPool, zeroed

    a = KVPool(2, 4096, 2, 16, torch.bfloat16, "cpu")
    b = KVPool(2, 4096, 2, 16, torch.bfloat16, "cpu", kv_dtype=torch.float8_e4m3fn)
    assert a.buf.shape == (2, 2, 4096, 2, 16) and a.buf.dtype == torch.bfloat16 and a.buf.is_contiguous()
    assert b.buf.dtype == torch.float8_e4m3fn and not b.buf.float().any() and not a.buf.any()
    a.k[1][7] = 1.5
    assert float(a.buf.sum()) == 1.5 * 32 and not b.buf.float().any()
    c = zeroed((3, 5), torch.float32, torch.device("cpu"))
    c += 2
    assert torch.equal(c, torch.full((3, 5), 2.0)) and zeroed((0, 4), torch.int32, torch.device("cpu")).numel() == 0


def test_start_up_phases_are_timed(tiny_llama) -> None:
    """``Laps``: seconds by phase, in order, repeated names summed; the runner's start-up goes through it."""
    from services.worker.laps import Laps

    lap = Laps()
    for name in ("load", "kernels", "pool", "kernels"):
        lap(name)
    assert list(lap.s)[-3:] == ["load", "kernels", "pool"] and all(v >= 0 for v in lap.s.values())
    assert lap.s.get("process", 0) > 0  # (Linux: this process's age when the laps began)
    path, _ = tiny_llama
    with structlog.testing.capture_logs() as logs:
        ModelRunner(WorkerConfig(model=str(path), max_total_tokens=64), str(path))
    phases = next(r["startup_s"] for r in logs if r["event"] == "model_loaded")
    assert {"load", "kernels", "pool", "attention", "cuda_graphs", "piecewise"} <= set(phases), phases
