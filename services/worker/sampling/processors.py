"""Logit processors beyond the penalties: ``logit_bias``, ``min_new_tokens`` and
``repetition_penalty``, on the device, for the rows of a step that use them (a step without such a
row never gets here: the default decode path is untouched).

Each request row keeps its state on the device from the step it is admitted: its bias as (token
ids, values), its stop ids, and for a repetition penalty a (V,) mask of the tokens its prompt and
output hold, updated on the device with each sampled token (so a step queued before the previous
one finished still sees it: overlap scheduling). A step's work is one gather / scatter per
processor over all its rows together, and no host synchronization.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from shared.messages.common import SamplingParams, from_i32
from shared.messages.to_worker import NewReq
from services.worker.hostio import to_device


@dataclass
class _RowState:
    bias_ids: torch.Tensor | None = None  # (B,) int64
    bias_vals: torch.Tensor | None = None  # (B,) float32
    stop_ids: torch.Tensor | None = None  # (S,) int64: masked until min_new_tokens are out
    min_until: int = 0  # the sequence length before which they are masked (prompt + min_new_tokens)
    seen: torch.Tensor | None = None  # (V,) bool: tokens in prompt + output (repetition penalty)
    penalty: float = 1.0


class LogitProcessors:
    """What the worker keeps per request row for its logit processors, and their per-step work."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size, self.device = vocab_size, device
        self.rows: dict[int, _RowState] = {}

    def add_row(self, nr: NewReq) -> None:
        p, dev = nr.params, self.device
        if not p.processed:
            return
        st = _RowState()
        if p.logit_bias:
            ids = [t for t in p.logit_bias if 0 <= t < self.vocab_size]
            st.bias_ids = to_device(ids, torch.int64, dev)
            st.bias_vals = to_device([p.logit_bias[t] for t in ids], torch.float32, dev)
        if p.min_new_tokens > 0 and p.stop_token_ids:
            st.stop_ids = to_device([t for t in p.stop_token_ids if 0 <= t < self.vocab_size], torch.int64, dev)
            st.min_until = nr.prompt_len + p.min_new_tokens
        if p.repetition_penalty != 1.0:
            st.penalty = p.repetition_penalty
            seen = np.concatenate([from_i32(nr.prompt_ids), from_i32(nr.output_ids)])
            st.seen = torch.zeros(self.vocab_size, dtype=torch.bool, device=dev)
            if len(seen):
                st.seen[to_device(seen.astype(np.int64), torch.int64, dev)] = True
        self.rows[nr.row] = st

    def drop_row(self, row: int) -> None:
        self.rows.pop(row, None)

    def apply(self, logits: torch.Tensor, rows: list[int], params: list[SamplingParams], seq_end: np.ndarray) -> None:
        """Process ``logits`` (N, V) in place: row k belongs to request row ``rows[k]`` whose next
        token follows ``seq_end[k]`` tokens. Order: repetition penalty, bias, the min-tokens mask."""
        states = [(k, self.rows.get(r)) for k, (r, p) in enumerate(zip(rows, params)) if p.processed]
        states = [(k, st) for k, st in states if st is not None]
        if not states:
            return
        dev = logits.device
        rep = [(k, st) for k, st in states if st.seen is not None]
        if rep:
            idx = to_device([k for k, _ in rep], torch.int64, dev)
            seen = torch.stack([st.seen for _, st in rep])  # (R, V)
            pen = to_device([st.penalty for _, st in rep], logits.dtype, dev)[:, None]  # (R, 1)
            sub = logits[idx]
            logits[idx] = torch.where(seen, torch.where(sub > 0, sub / pen, sub * pen), sub)
        bias = [(k, st) for k, st in states if st.bias_ids is not None and len(st.bias_ids)]
        if bias:
            at = _row_index([(k, st.bias_ids) for k, st in bias], dev)
            vals = torch.cat([st.bias_vals for _, st in bias]).to(logits.dtype)
            logits.index_put_((at, torch.cat([st.bias_ids for _, st in bias])), vals, accumulate=True)
        masked = [(k, st) for k, st in states
                  if st.stop_ids is not None and len(st.stop_ids) and int(seq_end[k]) < st.min_until]
        if masked:
            at = _row_index([(k, st.stop_ids) for k, st in masked], dev)
            cols = torch.cat([st.stop_ids for _, st in masked])
            logits.index_put_((at, cols), torch.full_like(cols, 0, dtype=logits.dtype).fill_(float("-inf")))

    def record(self, rows: list[int], tokens: torch.Tensor) -> None:
        """The tokens (device, one per entry of ``rows``) just sampled: into the repetition masks."""
        rep = [(k, self.rows[r]) for k, r in enumerate(rows) if r in self.rows and self.rows[r].seen is not None]
        for k, st in rep:
            st.seen.index_fill_(0, tokens[k:k + 1], True)


def _row_index(parts: list[tuple[int, torch.Tensor]], device: torch.device) -> torch.Tensor:
    """The logits row of each entry of the concatenated per-row id tensors (built on the host from
    their lengths: a device-side repeat_interleave would wait for the device to size its output)."""
    return to_device(np.repeat([k for k, _ in parts], [len(t) for _, t in parts]), torch.int64, device)
