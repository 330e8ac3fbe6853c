"""A step run as two lanes (issue 18, W2; opt-in: ``BANYAN_SPLIT_MIXED=<prompt tokens>``,
``BANYAN_SPLIT_DECODE=<rows>``).

A mixed step's decode rows and its prompt chunks are different requests: nothing in one's forward reads the
other's. Run as one batch, every layer does the GEMMs of all the step's tokens (compute-bound: the prompt tokens)
and then the attention, where the decode rows read their whole KV (memory-bound: ~600 rows × ~1.3k tokens in
W2's plateau, ~25 ms of HBM a step) while the tensor cores idle. Run as two lanes, the decode lane's attention can
run beside the prompt lane's GEMMs (NanoFlow's observation; stream priority decides whose blocks take the SMs a
kernel frees). The cost: the decode lane reads the weights once more for its own GEMMs
(M = its rows), on an HBM the prompt GEMMs leave mostly idle. Whether it pays is a measurement
(``benchmarks/gpu/overlap_probe.py``, then W2 with the knob): off by default. Measured on the H200 (docs/perf.md,
2026-12-05): it does not — cuBLAS's GEMMs and the decode attention each take every SM, the two streams' kernels run
one after the other (−16 to +17 µs a layer), W2's plateau steps −3 to +1 %; kept as an opt-in, tested path.

The same holds for a large decode step's two halves (``BANYAN_SPLIT_DECODE``: decode steps of that many rows or
more that no decode graph holds — W2's plateau runs ~600 rows, above the graphs' 512): one half's attention beside
the other's GEMMs, the high-priority lane ahead by its head start (NanoFlow's nano-batches, two of them).

- The decode lane: the step's leading one-token rows (the scheduler sends decodes first), on a stream of its own
  (high priority unless ``BANYAN_SPLIT_PRIORITY=0``), with an attention backend of its own (its own FlashInfer
  workspace and plans: the lanes' kernels run at once), through the piecewise graphs when they hold its rows.
- The prompt lane (or the second half): the other rows, eager on the step's stream, with the runner's backend
  and its between-layer calls. Both plans are made (on the host) before either lane is queued.
- The lanes join before the logits: one lm_head GEMM for both lanes' sampled rows, in batch order, on the step's
  stream. Neither lane uses the small-M kernels (whose tile counts are one buffer a device): both have > 16 rows.

A mixed step splits only with ``BANYAN_SPLIT_MIN_DECODES`` (64) decode rows or more ahead of ≥ the knob's prompt
tokens, nothing else (no scoring rows, no shared-prefix groups, no logits of every token), on one GPU (two lanes'
all-reduces on two streams would race on the communicator). The decode lane's Triton decode (FP8 pools) has pair
counts of its own. On the CPU the lanes run one after the other: the same path, tested.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import numpy as np
import torch

from services.worker.attention import make_backend
from services.worker.attention.base import AttentionBatch
from services.worker.hostio import to_device
from services.worker.kernels import MAX_M


@dataclass(frozen=True)
class SplitKnobs:
    min_prompt: int  # prompt tokens a mixed step needs to split (0: never)
    min_decodes: int  # decode rows it needs
    decode_rows: int  # rows a decode-only step needs to run as two halves (0: never)
    priority: bool  # the decode lane's stream at high priority


def split_knobs() -> SplitKnobs:
    """``BANYAN_SPLIT_MIXED`` (prompt tokens; unset or 0: off), ``BANYAN_SPLIT_MIN_DECODES`` (64),
    ``BANYAN_SPLIT_DECODE`` (rows; 0: off), ``BANYAN_SPLIT_PRIORITY`` (1): read once, when a runner is built."""
    env = os.environ.get
    knobs = SplitKnobs(int(env("BANYAN_SPLIT_MIXED", "0")), int(env("BANYAN_SPLIT_MIN_DECODES", "64")),
                       int(env("BANYAN_SPLIT_DECODE", "0")), env("BANYAN_SPLIT_PRIORITY", "1") != "0")
    if knobs.min_prompt < 0 or knobs.min_decodes <= MAX_M or knobs.decode_rows < 0 or \
            0 < knobs.decode_rows < 2 * (MAX_M + 1):
        raise ValueError(f"BANYAN_SPLIT_MIXED={knobs.min_prompt} (>= 0), BANYAN_SPLIT_MIN_DECODES={knobs.min_decodes} "
                         f"(> {MAX_M}), BANYAN_SPLIT_DECODE={knobs.decode_rows} (0 or >= {2 * (MAX_M + 1)}): each "
                         f"lane above the small-M kernels' rows (their tile counts are one buffer a device)")
    return knobs


class StepLanes:
    def __init__(self, knobs: SplitKnobs, backend: str, pool, num_q_heads: int, decode: str,
                 device: torch.device) -> None:
        self.knobs = knobs
        self.attn = make_backend(backend, pool, num_q_heads, decode)  # the decode lane's own plans and workspace
        self.stream = None
        if device.type == "cuda":
            self.stream = torch.cuda.Stream(device, priority=-1 if knobs.priority else 0)
            if hasattr(self.attn, "counts"):  # (both lanes may run the Triton decode at once: decode halves)
                from services.worker.attention import triton_decode

                self.attn.counts = torch.zeros(triton_decode.MAX_PAIRS, dtype=torch.int32, device=device)
        self.steps = 0  # steps run as two lanes

    @classmethod
    def build(cls, backend: str, pool, num_q_heads: int, decode: str, device: torch.device,
              tp_size: int) -> StepLanes | None:
        knobs = split_knobs()
        if not (knobs.min_prompt or knobs.decode_rows) or tp_size > 1:
            return None
        return cls(knobs, backend, pool, num_q_heads, decode, device)

    def rows(self, extend: np.ndarray) -> int:
        """How many leading rows run as the first lane (0: the step runs whole): a mixed step's decode rows — at
        least ``min_decodes`` one-token rows first, then only prompt chunks (≥ 2 tokens), ``min_prompt`` tokens or
        more — or half of a decode step of ``decode_rows`` rows or more."""
        chunks = np.flatnonzero(extend > 1)
        if not len(chunks):
            return len(extend) // 2 if self.knobs.decode_rows and len(extend) >= self.knobs.decode_rows else 0
        if not self.knobs.min_prompt:
            return 0
        nd = int(chunks[0])
        if nd < self.knobs.min_decodes or len(chunks) != len(extend) - nd:
            return 0
        return nd if int(extend[nd:].sum()) >= self.knobs.min_prompt else 0

    def logits(self, r, nd: int, dev: torch.Tensor, views: tuple[torch.Tensor, ...], prefix: np.ndarray,
               extend: np.ndarray, sample: np.ndarray, fence) -> torch.Tensor:
        """The step's logits (N, V) float32 of its sampled rows in batch order, its first ``nd`` rows (decodes) as the
        first lane. ``r``: the runner (model, backend, pieces, between-layer calls); ``fence()``: the step's waits
        for the host tier's copies (on the step's stream, before the lanes fork); ``views``: the
        step's device inputs (ids, slots, positions by token; rows, prefix lens, extend lens by row), slices of
        ``dev``; the table already holds the step's slots."""
        ids, slots, pos, rows, prefix_d, extend_d = views
        device = dev.device
        lanes = [AttentionBatch(req_to_token=r.req_to_token, rows=rows[sl], prefix_lens=prefix_d[sl],
                                extend_lens=extend_d[sl], out_slots=slots[sl], positions=pos[sl],  # (the first nd
                                prefix_lens_cpu=prefix[sl].tolist(), extend_lens_cpu=extend[sl].tolist())  # rows: nd
                 for sl in (slice(0, nd), slice(nd, None))]  # tokens, so one slice serves rows and tokens)
        self.attn.prepare(lanes[0])
        r.attn.prepare(lanes[1])
        pick_d = to_device(np.flatnonzero(sample[:nd]), torch.int64, device)
        pick_p = to_device((np.cumsum(extend[nd:]) - 1)[sample[nd:]], torch.int64, device)
        fence()
        if r.between_layers is not None:
            r.between_layers()
        main = torch.cuda.current_stream(device) if self.stream is not None else None
        if self.stream is not None:
            self.stream.wait_stream(main)
            dev.record_stream(self.stream)  # (read there: its memory not reused on the step's stream before)
        with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
            if r.pieces is not None and r.pieces.size_for(nd) is not None:
                hidden_d = r.pieces.forward(ids[:nd], pos[:nd], self.attn, None, slots[:nd])
            else:
                hidden_d = r.model.forward(ids[:nd], pos[:nd], self.attn)
        hidden_p = r.model.forward(ids[nd:], pos[nd:], r.attn, r.between_layers)
        if self.stream is not None:
            main.wait_stream(self.stream)
        self.steps += 1
        if not sample.any():
            return hidden_p[:0, :0]
        return r.model.compute_logits(torch.cat([hidden_d[pick_d], hidden_p[pick_p]]))
