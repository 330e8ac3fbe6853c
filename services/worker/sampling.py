"""Next-token sampling: greedy, or temperature + top-k/top-p/min-p filtering and a draw."""

from __future__ import annotations

import torch

from shared.messages.common import SamplingParams


class Sampler:
    """Samples one token per row. Rows draw from their request's generator (seeded requests: their
    tokens do not depend on what else is in the batch) or, given None, from one generator seeded
    with ``seed``; rows sharing a generator draw together."""

    def __init__(self, seed: int = 0) -> None:
        self._seed = seed
        self._shared: torch.Generator | None = None  # created on the device of the first logits

    def sample(
        self, logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
    ) -> torch.Tensor:
        """logits (B, V) float32 -> (B,) int64 token ids."""
        tokens = logits.argmax(dim=-1)  # (B,)
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if rows:
            index = torch.tensor(rows, device=logits.device)
            probs, ids = _filtered_probs(logits[index], [params[i] for i in rows])  # (S, V) each
            picks = self._draw(probs, [generators[i] for i in rows])  # (S,) into the sorted vocab
            tokens[index] = ids.gather(1, picks[:, None]).squeeze(1)
        return tokens

    def _draw(self, probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
        """One multinomial draw per row of unnormalized probs (S, V) -> (S,)."""
        if self._shared is None:
            self._shared = torch.Generator(device=probs.device).manual_seed(self._seed)
        groups: dict[int, tuple[torch.Generator, list[int]]] = {}
        for i, g in enumerate(generators):
            g = g if g is not None else self._shared
            groups.setdefault(id(g), (g, []))[1].append(i)
        picks = torch.empty(len(generators), dtype=torch.int64, device=probs.device)
        for g, rows in groups.values():
            picks[rows] = torch.multinomial(probs[rows], 1, generator=g).squeeze(1)
        return picks


def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (S, V) -> (probs, token ids), both (S, V) sorted by descending probability; the
    probs of filtered-out tokens are 0 and the rest are not renormalized."""
    vocab = logits.shape[1]

    def column(values: list[float] | list[int], dtype: torch.dtype) -> torch.Tensor:  # (S, 1)
        return torch.tensor(values, dtype=dtype, device=logits.device)[:, None]

    temperature = column([p.temperature for p in params], torch.float32)
    top_k = column([p.top_k if p.top_k > 0 else vocab for p in params], torch.int64)
    top_p = column([p.top_p for p in params], torch.float32)
    min_p = column([p.min_p for p in params], torch.float32)

    sorted_logits, ids = (logits / temperature).sort(dim=-1, descending=True)  # (S, V)
    rank = torch.arange(vocab, device=logits.device)[None, :]  # (1, V)
    probs = sorted_logits.masked_fill(rank >= top_k, float("-inf")).softmax(dim=-1)
    # top-p: drop tokens once the mass before them exceeds top_p (the most likely token stays)
    probs = probs.masked_fill(probs.cumsum(dim=-1) - probs > top_p, 0.0)
    # min-p: drop tokens less likely than min_p times the most likely one
    probs = probs.masked_fill(probs < min_p * probs[:, :1], 0.0)
    return probs, ids
