"""Between the model and the StepOutput: per-request sampling state and the per-step logit work —
grammar bitmasks, presence/frequency penalties, the logit processors (``processors.py``), seeded draws,
logprobs, prompt (scoring) logprobs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from shared.messages.common import SamplingParams, f32, from_i32, i32
from shared.messages.to_worker import ForwardBatch, NewReq
from services.worker.hostio import HostCopy, to_device
from services.worker.sampling.logits import PenaltyState, apply_bitmask, logprobs, step_seed
from services.worker.sampling.draw import TokenSampler
from services.worker.sampling.processors import LogitProcessors


SCORE_ROWS = 512  # prompt positions whose logits are made at once (512 × a 128k vocabulary: 256 MiB in fp32)


class BatchSampler:
    """Owns what the worker keeps per request row (its params, penalty counts) and turns the logits
    of one step into sampled ids plus the optional logprob fields of ``StepOutput``."""

    def __init__(self, sampler: TokenSampler, vocab_size: int, device: torch.device) -> None:
        self.sampler, self.device = sampler, device
        self.params: dict[int, SamplingParams] = {}  # by row
        self.penalties = PenaltyState(vocab_size, device)
        self.processors = LogitProcessors(vocab_size, device)

    def admit(self, nr: NewReq) -> None:
        self.params[nr.row] = nr.params
        if nr.params.penalized:
            self.penalties.add_row(nr.row, from_i32(nr.output_ids))
        if nr.params.processed:
            self.processors.add_row(nr)

    def release(self, row: int) -> None:
        self.params.pop(row, None)
        self.penalties.drop_row(row)
        self.processors.drop_row(row)

    def sample(self, b: ForwardBatch, logits: torch.Tensor, sample: np.ndarray, bitmask: bytes = b"") -> Sampled:
        """logits (N, V) of the N sampling requests (batch order) → their ids on the device, with
        the logprob tensors when asked for; nothing waits for the device (``finish`` does).
        ``bitmask``: the grammar rows of ``b.mask_rows`` (``b.bitmask`` unless it was deferred)."""
        dev = self.device
        sel = np.flatnonzero(sample)  # batch index of each logits row
        rows = from_i32(b.rows)[sel].tolist()
        params = [self.params[r] for r in rows]
        want_lp = any(p.logprobs for p in params)
        raw = logits.clone() if want_lp else logits  # logprobs report the model's own distribution
        bitmask = bitmask or b.bitmask
        if b.mask_rows and bitmask:
            where = {int(i): k for k, i in enumerate(sel)}
            mask_rows = from_i32(b.mask_rows)
            apply_bitmask(logits, np.frombuffer(bitmask, dtype="<i4").reshape(len(mask_rows), -1).copy(),
                          [where[int(i)] for i in mask_rows])
        pen = [k for k, p in enumerate(params) if p.penalized]
        if pen:
            self.penalties.apply(logits, [rows[k] for k in pen], pen, [params[k].presence_penalty for k in pen],
                                 [params[k].frequency_penalty for k in pen])
        seq_end = (from_i32(b.prefix_lens) + from_i32(b.extend_lens))[sel]  # tokens before each row's next one
        proc = [k for k, p in enumerate(params) if p.processed] if self.processors.rows else []
        if proc:  # logit_bias, min_new_tokens, repetition_penalty: only rows that ask (none held: no scan)
            self.processors.apply(logits, rows, params, seq_end)
        # seeded requests: a generator per (seed, position) — reproducible whatever the batch
        gens = [torch.Generator(device=dev).manual_seed(step_seed(p.seed, int(pos)))
                if p.seed is not None and not p.greedy else None for p, pos in zip(params, seq_end)]
        next_ids = self.sampler.sample(logits, params, gens)
        if pen:
            self.penalties.record([rows[k] for k in pen], next_ids[to_device(pen, torch.int64, dev)])
        if proc:
            self.processors.record([rows[k] for k in proc], next_ids[to_device(proc, torch.int64, dev)])
        out = Sampled(sel=sel, ids=next_ids)
        if want_lp:
            out.top_k = max(p.top_logprobs for p in params)
            out.logprobs = logprobs(raw, next_ids, out.top_k)
        return out

    @staticmethod
    def copy_back(s: Sampled, scores: dict[str, torch.Tensor]) -> HostCopy:
        """Start copying a step's results to the host (ids, logprobs, prompt logprobs)."""
        tensors = {"ids": s.ids} if s is not None else {}
        if s is not None and s.logprobs is not None:
            tensors.update(zip(("lp", "top_ids", "top_lp"), s.logprobs))
        return HostCopy({**tensors, **scores})

    @staticmethod
    def finish(s: Sampled | None, n: int, host: dict[str, np.ndarray]) -> tuple[np.ndarray, dict]:
        """→ (sampled id per batch row, -1 where not sampled; StepOutput's optional fields)."""
        out = np.full(n, -1, dtype=np.int32)
        extra: dict = {}
        if "prompt_logprobs" in host:
            extra.update(prompt_logprobs=f32(host["prompt_logprobs"]), prompt_logprob_counts=i32(host["counts"]))
        if "prompt_top_ids" in host:
            extra.update(prompt_top_k=int(host["prompt_top_ids"].shape[1]),
                         prompt_top_ids=host["prompt_top_ids"].astype("<i4").tobytes(),
                         prompt_top_logprobs=host["prompt_top_lp"].astype("<f4").tobytes())
        if s is None:
            return out, extra
        out[s.sel] = host["ids"]
        if s.logprobs is not None:
            k = s.top_k
            full_lp = np.zeros(n, np.float32)
            full_lp[s.sel] = host["lp"]
            extra.update(logprobs=f32(full_lp), top_k=k)
            if k:
                ids_full = np.zeros((n, k), np.int32)
                lp_full = np.zeros((n, k), np.float32)
                ids_full[s.sel], lp_full[s.sel] = host["top_ids"], host["top_lp"]
                extra.update(top_ids=ids_full.astype("<i4").tobytes(), top_logprobs=lp_full.astype("<f4").tobytes())
        return out, extra


@dataclass
class Sampled:
    """One step's sampled tokens, still on the device."""

    sel: np.ndarray  # batch index of each sampled row
    ids: torch.Tensor  # (S,) int64
    logprobs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # chosen (S,), top ids / lps (S, k)
    top_k: int = 0


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


def score_top_k(b: ForwardBatch, params: dict[int, SamplingParams]) -> int:
    """The most prompt-logprob alternatives any score row of ``b`` asked for."""
    rows = from_i32(b.rows)
    return max((params[int(rows[i])].prompt_top_logprobs for i in from_i32(b.score_rows)), default=0)


def prompt_logprobs(logits_of: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor | None,
                    targets: np.ndarray, counts: list[int], k: int = 0) -> dict[str, torch.Tensor]:
    """Prompt log-probs: the logprob of each target under its position's logits and, with ``k``,
    the ``k`` most likely tokens there (device tensors, copied back with the step's other results).
    ``hidden`` (P, H): the scored positions' hidden states; their logits are made ``SCORE_ROWS`` at a
    time (a whole prompt's (P, V) logits at once could not fit: 8k positions of a 128k vocabulary
    are 4 GiB in fp32)."""
    out = {"counts": torch.tensor(counts, dtype=torch.int32)}
    if hidden is None or not len(targets):
        out["prompt_logprobs"] = torch.zeros(0, dtype=torch.float32)
        return out
    tgt = to_device(targets, torch.int64, hidden.device)
    vals, top_ids, top_lps = [], [], []
    for lo in range(0, len(targets), SCORE_ROWS):
        lp = torch.log_softmax(logits_of(hidden[lo:lo + SCORE_ROWS]).float(), dim=-1)  # (≤ SCORE_ROWS, V)
        vals.append(lp.gather(1, tgt[lo:lo + SCORE_ROWS].view(-1, 1)).squeeze(1))
        if k:
            t_lp, t_ids = lp.topk(k, dim=-1)
            top_ids.append(t_ids.int())
            top_lps.append(t_lp)
    out["prompt_logprobs"] = torch.cat(vals)
    if k:
        out.update(prompt_top_ids=torch.cat(top_ids), prompt_top_lp=torch.cat(top_lps))
    return out
