"""Mixed steps as two lanes (``services/worker/split_step.py``, ``BANYAN_SPLIT_MIXED``) on the CPU: the decode rows'
forward and the prompt chunks' forward run apart (one after the other here; on two streams on a GPU) and give the
sampled rows' logits of the step run whole — against HF, through the runner's real path (the decode lane's own
backend, the piecewise pieces when they hold its rows, the tokens still on the device resolved before the fork).
The GPU's concurrent lanes: tests/gpu/test_split_step_gpu.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tests.worker.test_models import hf_logits, random_seqs
from tests.worker.test_runner import tiny_llama  # noqa: F401  (the fixture: a 2-layer random Llama)

from benchmarks.driver import Driver
from services.worker.runner import ModelRunner
from services.worker.split_step import SplitKnobs, StepLanes, split_knobs
from shared.config import WorkerConfig

DECODES = 18  # decode rows of the mixed step (the knob's floor is 17: above the small-M kernels' rows)


def _runner(path, monkeypatch, split: bool, pieces: int = 0, halves: int = 0) -> ModelRunner:
    monkeypatch.setenv("BANYAN_SPLIT_MIXED", "10" if split else "0")
    monkeypatch.setenv("BANYAN_SPLIT_MIN_DECODES", str(DECODES))
    monkeypatch.setenv("BANYAN_SPLIT_DECODE", str(halves))
    return ModelRunner(WorkerConfig(model=str(path), max_total_tokens=2048, piecewise_cuda_graph_max_tokens=pieces),
                       str(path))


@pytest.mark.parametrize("pieces", [0, 32], ids=["decode_lane_eager", "decode_lane_pieces"])
def test_split_mixed_step_matches_the_whole_step_and_hf(tiny_llama, monkeypatch, pieces) -> None:
    path, hf = tiny_llama
    seqs = random_seqs([5 + i % 7 for i in range(DECODES)] + [9, 14, 6])
    outs, kinds = [], []
    for split in (False, True):
        runner = _runner(path, monkeypatch, split, pieces)
        assert (runner.lanes is not None) == split
        driver = Driver(runner, max_rows=DECODES + 4)
        first = driver.run([(f"d{i}", seqs[i], True) for i in range(DECODES)])  # prompts, each samples
        # the mixed step: every decode row's input still on the device (-1), then two prompt chunks (9 + 14 tokens)
        work = [(f"d{i}", [-1], True) for i in range(DECODES)] + [("p0", seqs[-3], True), ("p1", seqs[-2][:10], False),
                                                                  ("p2", seqs[-1][:4], True)]
        logits = runner.forward(driver.batch(work))
        kinds.append(runner._kind)
        after = driver.run([(f"d{i}", [-1], True) for i in range(DECODES)] + [("p1", seqs[-2][10:], True)])
        outs.append((first, logits, after))
        if split:
            assert runner.lanes.steps == 1
    assert kinds == ["mixed", "mixed_split"]
    (first, whole, after), (first_s, lanes, after_s) = outs
    assert first.tolist() == first_s.tolist()
    torch.testing.assert_close(lanes, whole, rtol=1e-5, atol=1e-5)
    assert after.tolist() == after_s.tolist()  # (the KV both lanes wrote, read by the next step)
    want = [hf_logits(hf, seqs[i] + [int(first[i])])[-1] for i in range(DECODES)]
    want += [hf_logits(hf, seqs[-3])[-1], hf_logits(hf, seqs[-1][:4])[-1]]
    assert lanes.shape[0] == DECODES + 2
    torch.testing.assert_close(lanes, torch.stack(want), rtol=1e-4, atol=1e-4)
    assert after_s[-1] == hf_logits(hf, seqs[-2])[-1].argmax().item()


def test_which_steps_split(monkeypatch) -> None:
    split = object.__new__(StepLanes)
    split.knobs = SplitKnobs(min_prompt=100, min_decodes=20, decode_rows=0, priority=True)
    ext = np.array([1] * 20 + [60, 40], dtype=np.int64)
    assert split.rows(ext) == 20
    assert split.rows(np.array([1] * 19 + [60, 40])) == 0  # too few decodes
    assert split.rows(np.array([1] * 20 + [60, 39])) == 0  # too few prompt tokens
    assert split.rows(np.array([1] * 20 + [60, 1, 40])) == 0  # a one-token chunk after the prompts
    assert split.rows(np.array([60] + [1] * 20 + [40])) == 0  # decodes not first
    assert split.rows(np.array([1] * 30)) == 0  # decodes only: the decode graphs' step
    assert split.rows(np.array([200, 40])) == 0
    split.knobs = SplitKnobs(min_prompt=0, min_decodes=20, decode_rows=40, priority=True)
    assert split.rows(np.array([1] * 40)) == 20 and split.rows(np.array([1] * 41)) == 20  # decode halves
    assert split.rows(np.array([1] * 39)) == 0 and split.rows(ext) == 0  # (mixed steps: off)
    monkeypatch.setenv("BANYAN_SPLIT_MIXED", "2048")
    monkeypatch.delenv("BANYAN_SPLIT_MIN_DECODES", raising=False)
    monkeypatch.delenv("BANYAN_SPLIT_DECODE", raising=False)
    assert split_knobs() == SplitKnobs(2048, 64, 0, True)
    monkeypatch.setenv("BANYAN_SPLIT_DECODE", "33")  # (a half of 16 rows: the small-M kernels')
    with pytest.raises(ValueError, match="small-M"):
        split_knobs()
    monkeypatch.setenv("BANYAN_SPLIT_DECODE", "0")
    monkeypatch.setenv("BANYAN_SPLIT_MIN_DECODES", "16")
    with pytest.raises(ValueError, match="small-M"):
        split_knobs()
    monkeypatch.setenv("BANYAN_SPLIT_MIN_DECODES", "64")
    monkeypatch.setenv("BANYAN_SPLIT_MIXED", "-1")
    with pytest.raises(ValueError):
        split_knobs()


def test_steps_that_do_not_split_run_whole(tiny_llama, monkeypatch) -> None:
    """Logits of every token (scoring, tests) and too few decodes: the whole step."""
    path, hf = tiny_llama
    runner = _runner(path, monkeypatch, True)
    driver = Driver(runner, max_rows=DECODES + 4)
    seqs = random_seqs([6] * DECODES + [12])
    driver.run([(f"d{i}", seqs[i], True) for i in range(DECODES)])
    runner.forward(driver.batch([(f"d{i}", [-1], True) for i in range(DECODES)] + [("p", seqs[-1], True)]),
                   all_logits=True)
    assert runner._kind == "mixed" and runner.lanes.steps == 0
    driver.run([(f"d{i}", [-1], True) for i in range(DECODES - 1)] + [("q", seqs[-1], True)])
    assert runner._kind == "mixed" and runner.lanes.steps == 0


def test_decode_halves_match_the_whole_step_and_hf(tiny_llama, monkeypatch) -> None:
    """BANYAN_SPLIT_DECODE: a decode step above the graphs (here: no graphs) as two halves, the first through the
    piecewise pieces on its lane, the second eager."""
    path, hf = tiny_llama
    n = 2 * DECODES + 1
    seqs = random_seqs([4 + i % 9 for i in range(n)])
    results = []
    for halves in (0, 2 * DECODES):
        runner = _runner(path, monkeypatch, False, pieces=64, halves=halves)
        assert (runner.lanes is not None) == bool(halves)
        driver = Driver(runner, max_rows=n + 1)
        first = driver.run([(f"d{i}", seqs[i], True) for i in range(n)])
        logits = runner.forward(driver.batch([(f"d{i}", [-1], True) for i in range(n)]))
        kind = runner._kind
        nxt = driver.run([(f"d{i}", [-1], True) for i in range(n)])
        results.append((first, logits, kind, nxt, runner.lanes.steps if runner.lanes else 0))
    (first, whole, kind, nxt, _), (first_s, lanes, kind_s, nxt_s, steps) = results
    assert (kind, kind_s, steps) == ("decode_piecewise", "decode_split", 2)
    assert first.tolist() == first_s.tolist() and nxt.tolist() == nxt_s.tolist()
    torch.testing.assert_close(lanes, whole, rtol=1e-5, atol=1e-5)
    want = torch.stack([hf_logits(hf, seqs[i] + [int(first[i])])[-1] for i in range(n)])
    torch.testing.assert_close(lanes, want, rtol=1e-4, atol=1e-4)
