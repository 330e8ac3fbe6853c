"""Logit processing between the model and the sampler: grammar bitmasks, presence/frequency
penalties, and the log-probabilities returned to users. Works on any device."""

from __future__ import annotations

import numpy as np
import torch

_BITS = {}  # device → arange(32)


def apply_bitmask(logits: torch.Tensor, bitmask: np.ndarray, rows: list[int]) -> None:
    """Set to -inf the logits of tokens whose bit is 0. logits (N, V); bitmask int32 (M, W) with
    bit j of word w = token 32·w + j; ``rows`` are the M rows of ``logits`` it applies to."""
    dev = logits.device
    bits = _BITS.get(dev)
    if bits is None:
        bits = _BITS[dev] = torch.arange(32, device=dev, dtype=torch.int32)
    words = torch.from_numpy(bitmask).to(dev, non_blocking=True)  # (M, W)
    allowed = ((words.unsqueeze(-1) >> bits) & 1).view(len(rows), -1)[:, : logits.shape[1]]  # (M, V)
    idx = torch.tensor(rows, device=dev)
    logits[idx] = logits[idx].masked_fill(allowed == 0, float("-inf"))


class PenaltyState:
    """Counts of the tokens each penalized request generated, on the device (V ints per row)."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size, self.device = vocab_size, device
        self.counts: dict[int, torch.Tensor] = {}  # row → (V,) int32

    def add_row(self, row: int, generated: np.ndarray) -> None:
        c = torch.zeros(self.vocab_size, dtype=torch.int32, device=self.device)
        if len(generated):
            c.index_add_(0, torch.from_numpy(generated.astype(np.int64)).to(self.device),
                         torch.ones(len(generated), dtype=torch.int32, device=self.device))
        self.counts[row] = c

    def drop_row(self, row: int) -> None:
        self.counts.pop(row, None)

    def apply(self, logits: torch.Tensor, rows: list[int], idx: list[int], presence: list[float],
              frequency: list[float]) -> None:
        """logits[idx[k]] -= presence[k]·[count > 0] + frequency[k]·count, for request row rows[k]."""
        counts = torch.stack([self.counts[r] for r in rows]).to(logits.dtype)  # (K, V)
        p = torch.tensor(presence, device=logits.device, dtype=logits.dtype)[:, None]
        f = torch.tensor(frequency, device=logits.device, dtype=logits.dtype)[:, None]
        i = torch.tensor(idx, device=logits.device)
        logits[i] -= p * (counts > 0).to(logits.dtype) + f * counts

    def record(self, rows: list[int], tokens: list[int]) -> None:
        for r, t in zip(rows, tokens):
            c = self.counts.get(r)
            if c is not None:
                c[t] += 1


def logprobs(logits: torch.Tensor, chosen: torch.Tensor, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Log-softmax of the model's logits (N, V): the chosen tokens' logprobs (N,) and the top-k
    (ids (N, k), logprobs (N, k))."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen_lp = lp.gather(1, chosen.view(-1, 1)).squeeze(1)
    if k:
        top_lp, top_ids = lp.topk(k, dim=-1)
        return chosen_lp.cpu().numpy(), top_ids.int().cpu().numpy(), top_lp.cpu().numpy()
    empty = np.zeros((len(chosen), 0))
    return chosen_lp.cpu().numpy(), empty.astype(np.int32), empty.astype(np.float32)


def step_seed(seed: int, position: int) -> int:
    """The generator seed of a seeded request at one output position: reproducible whatever the
    batch, chunking or retraction (splitmix64 of seed and position)."""
    x = (seed * 0x9E3779B97F4A7C15 + position + 1) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (x ^ (x >> 31)) & 0x7FFFFFFFFFFFFFFF
