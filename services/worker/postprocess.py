"""Between the model and the StepOutput: per-request sampling state and the per-step logit work —
grammar bitmasks, presence/frequency penalties, seeded draws, logprobs, prompt (scoring) logprobs."""

from __future__ import annotations

import numpy as np
import torch

from shared.messages.common import SamplingParams, f32, from_i32, i32
from shared.messages.to_worker import ForwardBatch, NewReq
from services.worker.logits import PenaltyState, apply_bitmask, logprobs, step_seed
from services.worker.sampling import Sampler


class StepSampler:
    """Owns what the worker keeps per request row (its params, penalty counts) and turns the logits
    of one step into sampled ids plus the optional logprob fields of ``StepOutput``."""

    def __init__(self, sampler: Sampler, vocab_size: int, device: torch.device) -> None:
        self.sampler, self.device = sampler, device
        self.params: dict[int, SamplingParams] = {}  # by row
        self.penalties = PenaltyState(vocab_size, device)

    def admit(self, nr: NewReq) -> None:
        self.params[nr.row] = nr.params
        if nr.params.penalized:
            self.penalties.add_row(nr.row, from_i32(nr.output_ids))

    def release(self, row: int) -> None:
        self.params.pop(row, None)
        self.penalties.drop_row(row)

    def sample(self, b: ForwardBatch, logits: torch.Tensor, sample: np.ndarray) -> tuple[np.ndarray, dict]:
        """logits (N, V) of the N sampling requests (batch order) → (ids per batch row, -1 where not
        sampled; StepOutput logprob fields)."""
        out = np.full(len(sample), -1, dtype=np.int32)
        batch_rows = from_i32(b.rows)
        sel = np.flatnonzero(sample)  # batch index of each logits row
        rows = batch_rows[sel].tolist()
        params = [self.params[r] for r in rows]
        want_lp = any(p.logprobs for p in params)
        raw = logits.clone() if want_lp else logits  # logprobs report the model's own distribution
        if b.mask_rows:
            where = {int(i): k for k, i in enumerate(sel)}
            apply_bitmask(logits, np.frombuffer(b.bitmask, dtype="<i4").reshape(len(from_i32(b.mask_rows)), -1).copy(),
                          [where[int(i)] for i in from_i32(b.mask_rows)])
        pen = [k for k, p in enumerate(params) if p.penalized]
        if pen:
            self.penalties.apply(logits, [rows[k] for k in pen], pen, [params[k].presence_penalty for k in pen],
                                 [params[k].frequency_penalty for k in pen])
        # seeded requests: a generator per (seed, position) — reproducible whatever the batch
        seq_end = (from_i32(b.prefix_lens) + from_i32(b.extend_lens))[sel]
        gens = [torch.Generator(device=self.device).manual_seed(step_seed(p.seed, int(pos)))
                if p.seed is not None and not p.greedy else None for p, pos in zip(params, seq_end)]
        next_ids = self.sampler.sample(logits, params, gens)
        out[sel] = next_ids.cpu().numpy()
        if pen:
            self.penalties.record([rows[k] for k in pen], out[sel][pen].tolist())
        extra: dict = {}
        if want_lp:
            k = max(p.top_logprobs for p in params)
            lp, top_ids, top_lp = logprobs(raw, next_ids, k)
            full_lp = np.zeros(len(sample), np.float32)
            full_lp[sel] = lp
            extra.update(logprobs=f32(full_lp), top_k=k)
            if k:
                ids_full = np.zeros((len(sample), k), np.int32)
                lp_full = np.zeros((len(sample), k), np.float32)
                ids_full[sel], lp_full[sel] = top_ids, top_lp
                extra.update(top_ids=ids_full.astype("<i4").tobytes(), top_logprobs=lp_full.astype("<f4").tobytes())
        return out, extra


def score_positions(b: ForwardBatch) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """Token indices (into the step's concatenated tokens) whose logits scoring requests need, the
    prompt token each of them predicts, and how many belong to each score row."""
    prefix, extend, ids = from_i32(b.prefix_lens), from_i32(b.extend_lens), from_i32(b.input_ids)
    starts = np.cumsum(extend) - extend
    idx, targets, counts = [], [], []
    for i, first, nxt in zip(from_i32(b.score_rows), from_i32(b.score_from), from_i32(b.score_next)):
        lo = starts[i] + (first - prefix[i])
        hi = starts[i] + extend[i]  # exclusive; the last token's target is the one after the chunk
        tok = list(range(lo, hi))
        tgt = ids[lo + 1:hi].tolist() + [int(nxt)]
        if nxt < 0:
            tok, tgt = tok[:-1], tgt[:-1]
        idx += tok
        targets += tgt
        counts.append(len(tok))
    return np.asarray(idx, dtype=np.int64), np.asarray(targets, dtype=np.int64), counts


def prompt_logprobs(logits: torch.Tensor | None, targets: np.ndarray, counts: list[int]) -> dict:
    """StepOutput fields for scoring requests: logprob of each target under its position's logits."""
    if logits is not None and len(targets):
        lp = torch.log_softmax(logits.float(), dim=-1)
        vals = lp.gather(1, torch.from_numpy(targets).to(lp.device).view(-1, 1)).squeeze(1).cpu().numpy()
    else:
        vals = np.zeros(0, np.float32)
    return {"prompt_logprobs": f32(vals), "prompt_logprob_counts": i32(counts)}
