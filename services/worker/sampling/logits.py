"""Logit processing between the model and the sampler: grammar bitmasks, presence/frequency
penalties, and the log-probabilities returned to users. Works on any device."""

from __future__ import annotations

import numpy as np
import torch

from services.worker.hostio import to_device

_BITS = {}  # device → arange(32)


def apply_bitmask(logits: torch.Tensor, bitmask: np.ndarray, rows: list[int]) -> None:
    """Set to -inf the logits of tokens whose bit is 0. logits (N, V); bitmask int32 (M, W) with
    bit j of word w = token 32·w + j; ``rows`` are the M rows of ``logits`` it applies to."""
    dev = logits.device
    bits = _BITS.get(dev)
    if bits is None:
        bits = _BITS[dev] = torch.arange(32, device=dev, dtype=torch.int32)
    words = to_device(bitmask, torch.int32, dev)  # (M, W)
    allowed = ((words.unsqueeze(-1) >> bits) & 1).view(len(rows), -1)[:, : logits.shape[1]]  # (M, V)
    idx = to_device(rows, torch.int64, dev)
    logits[idx] = logits[idx].masked_fill(allowed == 0, float("-inf"))


class PenaltyState:
    """Counts of the tokens each penalized request generated, on the device (V ints per row)."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size, self.device = vocab_size, device
        self.counts: dict[int, torch.Tensor] = {}  # row → (V,) int32

    def add_row(self, row: int, generated: np.ndarray) -> None:
        c = torch.zeros(self.vocab_size, dtype=torch.int32, device=self.device)
        if len(generated):
            c.index_add_(0, to_device(generated, torch.int64, self.device),
                         torch.ones(len(generated), dtype=torch.int32, device=self.device))
        self.counts[row] = c

    def drop_row(self, row: int) -> None:
        self.counts.pop(row, None)

    def apply(self, logits: torch.Tensor, rows: list[int], idx: list[int], presence: list[float],
              frequency: list[float]) -> None:
        """logits[idx[k]] -= presence[k]·[count > 0] + frequency[k]·count, for request row rows[k]."""
        counts = torch.stack([self.counts[r] for r in rows]).to(logits.dtype)  # (K, V)
        p = to_device(presence, logits.dtype, logits.device)[:, None]
        f = to_device(frequency, logits.dtype, logits.device)[:, None]
        i = to_device(idx, torch.int64, logits.device)
        logits[i] -= p * (counts > 0).to(logits.dtype) + f * counts

    def record(self, rows: list[int], tokens: torch.Tensor) -> None:
        """Count the tokens (device, one per row) just sampled for ``rows`` — on the device, so the
        next step's penalties see them even when it was queued before this one finished."""
        one = torch.ones(1, dtype=torch.int32, device=tokens.device)
        for k, r in enumerate(rows):
            c = self.counts.get(r)
            if c is not None:
                c.index_add_(0, tokens[k : k + 1], one)


def logprobs(logits: torch.Tensor, chosen: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-softmax of the model's logits (N, V): the chosen tokens' logprobs (N,) and the top-k
    (ids (N, k) int32, logprobs (N, k)), on the device."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen_lp = lp.gather(1, chosen.view(-1, 1)).squeeze(1)
    top_lp, top_ids = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
    return chosen_lp, top_ids.int(), top_lp


def step_seed(seed: int, position: int) -> int:
    """The generator seed of a seeded request at one output position: reproducible whatever the
    batch, chunking or retraction (splitmix64 of seed and position)."""
    x = (seed * 0x9E3779B97F4A7C15 + position + 1) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (x ^ (x >> 31)) & 0x7FFFFFFFFFFFFFFF
