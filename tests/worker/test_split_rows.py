"""A chunk of forced tokens computed as one-token rows of the same request (what the scheduler
sends when the step can then replay a decode graph) gives the logits and the KV of the chunk
computed as one extend — checked on the CPU against HF, and on the GPU through the graph in
tests/gpu/test_gpu_parity.py."""

from __future__ import annotations

import torch
from tests.worker.test_models import hf_logits, random_seqs
from tests.worker.test_runner import tiny_llama  # noqa: F401  (the fixture: a 2-layer random Llama)

from benchmarks.driver import Driver
from services.worker.runner import ModelRunner
from shared.config import WorkerConfig


def test_forced_tokens_as_rows_match_the_chunk(tiny_llama) -> None:
    path, hf = tiny_llama
    runner = ModelRunner(WorkerConfig(model=str(path), max_total_tokens=512), str(path))
    driver = Driver(runner, max_rows=8)
    seq, other = random_seqs([17, 9])
    driver.run([("a", seq[:12], True), ("b", seq[:12], True), ("o", other[:8], True)])
    forced = seq[12:]
    chunk = runner.forward(driver.batch([("a", forced, True), ("o", other[8:], True)]), all_logits=True)
    rows = runner.forward(driver.batch([("b", [t], i == len(forced) - 1) for i, t in enumerate(forced)]
                                       + [("o2", other, True)]), all_logits=True)
    want = hf_logits(hf, seq)[12:]
    torch.testing.assert_close(chunk[: len(forced)], want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(rows[: len(forced)], want, rtol=1e-4, atol=1e-4)
    a, b = driver.reqs["a"], driver.reqs["b"]
    for layer in (0, runner.spec.num_layers - 1):  # the forced tokens' KV, written by the rows
        torch.testing.assert_close(runner.kv.k[layer][b.slots[12:]], runner.kv.k[layer][a.slots[12:]])
        torch.testing.assert_close(runner.kv.v[layer][b.slots[12:]], runner.kv.v[layer][a.slots[12:]])
    # sampled: only the last row; the next step's input (-1: on the device) is the token it sampled
    driver.run([("c", seq[:12], False)])
    out = driver.run([("c", [t], i == len(forced) - 1) for i, t in enumerate(forced)])
    nxt = hf_logits(hf, seq)[-1].argmax().item()
    assert out.tolist() == [-1] * (len(forced) - 1) + [nxt]
    assert driver.run([("c", [-1], True)])[0] == hf_logits(hf, seq + [nxt])[-1].argmax().item()
