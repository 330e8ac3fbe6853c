"""The worker's prompt log-probs (``sampling/batch.py``): made a slice of positions at a time, equal
to one log-softmax over all of them, alternatives included; nothing scored gives empty fields."""

from __future__ import annotations

import numpy as np
import torch

from services.worker.sampling import batch


def test_slices_equal_one_pass(monkeypatch):
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(64, 8, generator=g)  # (V, H): the "model's" head
    hidden = torch.randn(23, 8, generator=g)
    targets = np.arange(23) % 64

    def logits_of(h: torch.Tensor) -> torch.Tensor:
        assert len(h) <= 5
        return h @ weight.T

    monkeypatch.setattr(batch, "SCORE_ROWS", 5)
    got = batch.prompt_logprobs(logits_of, hidden, targets, [10, 13], k=3)
    lp = torch.log_softmax(hidden @ weight.T, dim=-1)
    assert torch.allclose(got["prompt_logprobs"], lp[torch.arange(23), torch.as_tensor(targets)], atol=1e-6)
    top = lp.topk(3, dim=-1)
    assert torch.allclose(got["prompt_top_lp"], top.values, atol=1e-6)
    assert torch.equal(got["prompt_top_ids"], top.indices.int())
    assert got["counts"].tolist() == [10, 13]
    none = batch.prompt_logprobs(logits_of, None, np.zeros(0, np.int64), [0], k=3)
    assert len(none["prompt_logprobs"]) == 0 and "prompt_top_ids" not in none
