"""Mixed steps as two lanes on a GPU (``BANYAN_SPLIT_MIXED``; skipped without CUDA + FlashInfer): the decode lane on
its own high-priority stream with its own backend, the prompt lane on the step's stream, both at once — each step's
sampled logits against the same steps run whole (bf16 and FP8 pools; the decode lane eager and through the
piecewise graphs), launched the way the worker serves the overlapping scheduler (step N+1 queued before N is
finished, its decode inputs the tokens N sampled, still on the device). The CPU test of the same path:
tests/worker/test_split_step.py."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch
from tests.gpu.test_gpu_parity import models, rel_err, runner, tokens  # noqa: F401  (the fixture: small models)

from benchmarks.driver import Driver

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None, reason="needs FlashInfer"),
]
DECODES, STEPS = 96, 6


def _steps(model, monkeypatch, split: bool, halves: bool = False,
           **cfg) -> tuple[list[torch.Tensor], list[list[int]], int]:
    """96 requests of 200–900 prompt tokens, then ``STEPS`` mixed steps: their decodes (inputs on the device) and a
    new 1,000-token prompt chunk each, each step launched before the previous one is finished → (the logits
    of each step's sampled rows, as the sampler got them; the tokens sampled; steps run split). ``halves``: decode
    steps only, run as two halves (the test's graphs hold 16 rows: these are eager)."""
    monkeypatch.setenv("BANYAN_SPLIT_MIXED", "512" if split and not halves else "0")
    monkeypatch.setenv("BANYAN_SPLIT_DECODE", "64" if split and halves else "0")
    r = runner(model, **{"max_total_tokens": 80000, **cfg})  # (96 × ≤ 900 tokens, 6 prompts of 1,000)
    assert (r.lanes is not None) == split
    logits, draw = [], r.batch_sampler.sample

    def sample(b, step_logits, *args):
        logits.append(step_logits.clone())
        return draw(b, step_logits, *args)

    driver = Driver(r, max_rows=DECODES + STEPS + 1)
    lens = np.random.default_rng(0).integers(200, 900, DECODES)
    for i in range(0, DECODES, 16):
        driver.run([(f"d{j}", tokens(int(lens[j]), 32000, j), True) for j in range(i, i + 16)])
    monkeypatch.setattr(r.batch_sampler, "sample", sample)
    sampled, prev = [], None
    for s in range(STEPS):
        work = [(f"d{j}", [-1], True) for j in range(DECODES)]
        if not halves:
            work.append((f"p{s}", tokens(1000, 32000, 1000 + s), True))
        launched = r.launch(driver.batch(work, follows=True))
        if prev is not None:
            sampled.append(r.finish(prev)[0].tolist())
        prev = launched
    sampled.append(r.finish(prev)[0].tolist())
    return logits, sampled, r.lanes.steps if split else 0


@pytest.mark.parametrize("halves", [False, True], ids=["mixed", "decode_halves"])
@pytest.mark.parametrize("cfg", [{}, {"piecewise_cuda_graph_max_tokens": 256}, {"kv_cache_dtype": "fp8_e4m3"}],
                         ids=["eager", "lane_pieces", "fp8_pool"])
def test_split_lanes_match_the_whole_step(models, monkeypatch, cfg, halves) -> None:
    whole, want, _ = _steps(models["small"], monkeypatch, False, halves, **cfg)
    lanes, got, n = _steps(models["small"], monkeypatch, True, halves, **cfg)
    rows = DECODES + (not halves)
    assert n == STEPS and len(lanes) == len(whole) == STEPS
    same = np.ones(rows, dtype=bool)  # rows whose inputs so far were the same in both runs
    for a, b, g, w in zip(lanes, whole, got, want, strict=True):
        assert a.shape == b.shape == (rows, 32000)
        # (bf16: the decode lane's GEMMs at M = 96, not M = 1,096 — other tiles, other sums)
        assert rel_err(a[same], b[same]) < 2e-2
        same[:DECODES] &= np.array(g[:DECODES]) == np.array(w[:DECODES])
    # (greedy on random weights: near-ties flip and the row's later inputs differ — H200: 86-90 % after 6 halves
    # steps; a race would scramble all of them)
    assert same.mean() >= 0.75, same.mean()

