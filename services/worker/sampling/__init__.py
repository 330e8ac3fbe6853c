"""Sampling on the worker: from one step's logits to the emitted tokens.

- ``logits.py``: what changes the logits before a draw — grammar bitmasks, presence/frequency
  penalties — and the log-probabilities returned to users;
- ``draw.py``: ``TokenSampler``, the draw itself (greedy, temperature, top-k / top-p / min-p; per
  request generators for seeded requests, FlashInfer's fused kernels for the rest);
- ``batch.py``: ``BatchSampler``, what the worker keeps per request row (its params, penalty
  counts) and the per-step work from a batch's logits to the ``StepOutput`` fields.
"""

from services.worker.sampling.batch import BatchSampler, Sampled, prompt_logprobs, score_positions, score_top_k
from services.worker.sampling.draw import TokenSampler, flashinfer_draw

__all__ = ["BatchSampler", "Sampled", "TokenSampler", "flashinfer_draw", "prompt_logprobs", "score_positions",
           "score_top_k"]
