"""The model runner: owns the weights, the KV pool, the ``req_to_token`` mirror, the CUDA graphs and
the per-request sampler state, and executes one ``ForwardBatch`` at a time. It decides nothing
about requests.

Kernels are chosen once, here: the attention backend (``--attention-backend``) also picks the
kernel set of the layers (FlashInfer's fused norm/rope/activation with flashinfer, the reference
ones with torch) and the draw of unseeded sampled rows.
"""

from __future__ import annotations

import os

import numpy as np
import torch
import torch.distributed as dist

from shared.config import WorkerConfig
from shared.logging import get_logger, stage
from shared.messages.common import SamplingParams, from_i32
from shared.messages.to_worker import ForwardBatch
from shared.tracing import Span, Tracer
from services.worker.attention import make_backend, resolve_backend
from services.worker.attention.base import AttentionBatch
from services.worker.cuda_graph import NUM_INPUTS, DecodeGraphs
from services.worker.kv_pool import KVPool, pool_slots_for_memory
from services.worker.models.layers import TPGroup
from services.worker.models.loader import load_model
from services.worker.models.ops import TORCH_OPS, flashinfer_ops
from services.worker.postprocess import StepSampler, prompt_logprobs, score_positions
from services.worker.sampling import Sampler, flashinfer_draw

log = get_logger("worker")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CPU_KV_BYTES = 1 << 30  # default KV budget on CPU


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """``auto``: this rank's GPU (``cuda:<local rank>``) when there is one, else the CPU."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", local_rank % torch.cuda.device_count())
        return torch.device("cpu")
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


class ModelRunner:
    def __init__(self, cfg: WorkerConfig, model_dir: str, tp: TPGroup | None = None,
                 tracer: Tracer | None = None) -> None:
        self.tp = tp or TPGroup()
        self.tracer = tracer or Tracer()
        self.device = resolve_device(cfg.device, self.tp.rank)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.dtype = resolve_dtype(cfg.dtype, self.device)
        self.backend = resolve_backend(cfg.attention_backend, self.device)
        fused = self.backend == "flashinfer"
        torch.manual_seed(cfg.seed)
        self.model, self.spec = load_model(model_dir, self.dtype, self.device, self.tp,
                                           flashinfer_ops() if fused else TORCH_OPS)
        self.context_length = cfg.context_length or self.spec.context_length
        kv_heads = self.spec.kv_heads_per_rank(self.tp.size)
        self.pool_size = cfg.max_total_tokens or self._default_pool_size(kv_heads, cfg.mem_fraction_static)
        self.kv = KVPool(self.spec.num_layers, self.pool_size + 1, kv_heads, self.spec.head_dim,
                         self.dtype, self.device)
        self.attn = make_backend(self.backend, self.kv, self.spec.num_heads // self.tp.size)
        self.sampler = Sampler(seed=cfg.seed, fused=flashinfer_draw() if fused else None)
        self.req_to_token = torch.zeros((1, self.context_length), dtype=torch.int32, device=self.device)
        self.pad_row = 0  # the table's last row: all zeros (slot 0), never a request's
        self.graphs: DecodeGraphs | None = None
        if self.device.type == "cuda" and self.attn.supports_cuda_graph and not cfg.disable_cuda_graph:
            with torch.inference_mode():
                self.graphs = DecodeGraphs(self.model, self.attn, cfg.cuda_graph_max_bs, self.context_length,
                                           self.device)
        self.post = StepSampler(self.sampler, self.spec.vocab_size, self.device)
        self.rids: dict[int, tuple[str, str, Span]] = {}  # by row: request id, trace id, ``forward`` span
        self._scores: dict = {}  # prompt-logprob fields of the last step, if it had scoring requests
        log.info("model_loaded", model=os.path.basename(model_dir.rstrip("/")), arch=self.spec.architecture,
                 device=str(self.device), dtype=str(self.dtype).removeprefix("torch."), pool_size=self.pool_size,
                 context_length=self.context_length, attention=self.backend, tp_rank=self.tp.rank,
                 tp_size=self.tp.size, cuda_graph_bs=self.graphs.batch_sizes if self.graphs else [])

    def _default_pool_size(self, kv_heads: int, mem_fraction: float) -> int:
        """KV slots that fit in what ``mem_fraction`` of the device leaves after the weights (SGLang's
        ``mem_fraction_static``: weights + KV pool); the same on every rank (the smallest)."""
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = int(free - total * (1 - mem_fraction))
            if budget <= 0:
                raise ValueError(f"no memory left for the KV pool: {free / 2**30:.1f} GiB free of "
                                 f"{total / 2**30:.1f} GiB after the weights; raise --mem-fraction-static")
        else:
            budget = CPU_KV_BYTES
        n = pool_slots_for_memory(budget, self.spec.num_layers, kv_heads, self.spec.head_dim, self.dtype)
        n = max(1, min(n - 1, 64 * self.context_length))  # slot 0 is padding
        if self.tp.size > 1:
            t = torch.tensor([n], dtype=torch.int64, device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.tp.group)
            n = int(t.item())
        return n

    def setup(self, max_rows: int) -> None:
        """Size the request table: rows 0..max_rows-1 for requests, row max_rows for padding."""
        self.req_to_token = torch.zeros((max_rows + 1, self.context_length), dtype=torch.int32, device=self.device)
        self.pad_row = max_rows

    @property
    def params(self) -> dict[int, SamplingParams]:
        return self.post.params

    def execute(self, b: ForwardBatch) -> np.ndarray:
        """Run one step; returns the sampled id per request in batch order (-1 where not sampled)."""
        return self.step(b)[0]

    @torch.inference_mode()
    def step(self, b: ForwardBatch) -> tuple[np.ndarray, dict]:
        """Run one step → (sampled id per request in batch order, -1 where not sampled; the optional
        StepOutput fields: logprobs, prompt logprobs). On TP ranks other than 0 nothing is sampled:
        rank 0 answers the scheduler."""
        sample = from_i32(b.sample).astype(bool)
        logits = self._logits(b, all_logits=False, copy=False)
        if self.tp.rank != 0 or not sample.any():
            return np.full(len(sample), -1, dtype=np.int32), self._scores
        ids, extra = self.post.sample(b, logits, sample)
        return ids, {**extra, **self._scores}

    @torch.inference_mode()
    def forward(self, b: ForwardBatch, all_logits: bool = False) -> torch.Tensor:
        """Apply the batch's table diffs and run the model -> logits (N, V) float32 of the requests
        that sample (in batch order), or of every new token with ``all_logits``."""
        return self._logits(b, all_logits, copy=True)

    def _logits(self, b: ForwardBatch, all_logits: bool, copy: bool) -> torch.Tensor:
        """``forward``; without ``copy``, a graph step's logits may be a view of the graph's output
        buffer, valid until the next step."""
        self._admit(b)
        rows, prefix, extend = from_i32(b.rows), from_i32(b.prefix_lens), from_i32(b.extend_lens)
        ids, slots = from_i32(b.input_ids), from_i32(b.out_slots)
        sample = from_i32(b.sample).astype(bool)
        n, t = len(rows), len(ids)
        positions = np.arange(t) - np.repeat(np.cumsum(extend) - extend - prefix, extend)  # (T,)
        self._scores = {}
        bs = self.graphs.size_for(n) if self.graphs is not None and t == n and not b.score_rows else None
        if bs is not None:  # pure decode: pad to the graph's size with the padding row
            pad = bs - n
            ids, slots, positions, rows, prefix = (np.pad(a, (0, pad)) for a in (ids, slots, positions, rows, prefix))
            rows[n:] = self.pad_row
            n = t = bs
        host = np.concatenate([ids, slots, positions, rows, prefix, extend, np.repeat(rows[: len(extend)], extend)])
        dev = torch.from_numpy(host.astype(np.int64)).to(self.device, non_blocking=True)
        if bs is not None:
            self.graphs.inputs[:, :bs].copy_(dev[: NUM_INPUTS * bs].view(NUM_INPUTS, bs))
            x = self.graphs.batch(self.req_to_token, bs, prefix.tolist())
            self.req_to_token[x.rows, x.positions] = x.out_slots.to(torch.int32)
            logits = self.graphs.replay(x)[: len(sample)]  # the graph's output buffer
            if all_logits or sample.all():
                return logits.clone() if copy else logits
            return logits[torch.from_numpy(sample).to(self.device)]
        ids_d, slots_d, pos_d = dev[:t], dev[t : 2 * t], dev[2 * t : 3 * t]
        rows_d, prefix_d = dev[3 * t : 3 * t + n], dev[3 * t + n : 3 * t + 2 * n]
        extend_d, tok_rows_d = dev[3 * t + 2 * n : 3 * t + 3 * n], dev[3 * t + 3 * n :]
        self.req_to_token[tok_rows_d, pos_d] = slots_d.to(torch.int32)
        batch = AttentionBatch(req_to_token=self.req_to_token, rows=rows_d, prefix_lens=prefix_d,
                               extend_lens=extend_d, out_slots=slots_d, positions=pos_d,
                               prefix_lens_cpu=prefix.tolist(), extend_lens_cpu=extend.tolist())
        self.attn.prepare(batch)
        hidden = self.model.forward(ids_d, pos_d, self.attn)  # (T, H)
        if b.score_rows:  # scoring requests: the logits of their prompt positions
            idx, targets, counts = score_positions(b)
            scored = self.model.compute_logits(hidden[torch.from_numpy(idx).to(self.device)]) if len(idx) else None
            self._scores = prompt_logprobs(scored, targets, counts)
        if not all_logits:
            if not sample.any():
                return hidden[:0, :0]
            last = (np.cumsum(extend) - 1)[sample]
            hidden = hidden[torch.from_numpy(last).to(self.device)]
        return self.model.compute_logits(hidden)  # (N, V)

    def end_spans(self) -> None:
        """End the spans of requests still holding rows (stopping: a row is released with the next
        batch, which may never come)."""
        for _, _, span in self.rids.values():
            span.end()

    def _admit(self, b: ForwardBatch) -> None:
        for row in b.released_rows:
            self.post.release(row)
            rid, trace_id, span = self.rids.pop(row, ("", "", Span("")))
            stage("worker_released", rid, trace_id=trace_id, row=row)
            span.end()
        for nr in b.new_reqs:
            trace_id = nr.traceparent[3:35]
            self.rids[nr.row] = (nr.rid, trace_id, self.tracer.start("forward", nr.traceparent, request_id=nr.rid,
                                                                      row=nr.row))
            stage("worker_admitted", nr.rid, trace_id=trace_id, row=nr.row, step=b.step)
            self.post.admit(nr)
            prefix = torch.from_numpy(from_i32(nr.prefix_slots).copy())
            self.req_to_token[nr.row, : prefix.numel()] = prefix.to(self.device)
