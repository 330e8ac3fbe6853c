"""The model runner: owns the weights, the KV pool, the ``req_to_token`` mirror, the CUDA graphs and
the per-request sampler state, and executes one ``ForwardBatch`` at a time. It decides nothing
about requests.

Kernels are chosen once, here: the attention backend (``--attention-backend``) also picks the
kernel set of the layers (FlashInfer's fused norm/rope/activation with flashinfer, the reference
ones with torch) and the draw of unseeded sampled rows.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist

from shared import knobs
from shared.config import PIECEWISE_AUTO_TOKENS, WorkerConfig
from shared.logging import get_logger, stage
from shared.messages.common import SamplingParams, from_i32
from shared.messages.to_worker import ForwardBatch
from shared.tracing import Span, Tracer
from services.worker.attention import make_backend, resolve_backend
from services.worker.attention.base import AttentionBatch, make_cascade
from services.worker.cuda_graph import IDS, NUM_INPUTS, ROWS, DecodeGraphs
from services.worker.piecewise import PiecewiseGraphs
from services.worker.host_pool import Tiers, build_tiers
from services.worker.kv_pool import KVPool, pool_slots_for_memory
from services.worker.tp import TPGroup
from services.worker.models.loader import load_model
from services.worker.kernels.ops import TORCH_OPS, flashinfer_ops
from services.worker.hostio import DeviceTimer, HostCopy, to_device
from services.worker.laps import Laps
from services.worker.launched import Launched, step_kind
from services.worker.sampling.batch import BatchSampler, prompt_logprobs, score_positions, score_top_k
from services.worker.startup import choose_kernels
from services.worker.quant.kv import layer_scales, resolve_kv_dtype
from services.worker.sampling.draw import TokenSampler, flashinfer_draw

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
        knobs.load()  # (the BANYAN_* knobs as this start finds them: read once, here, for what the runner builds)
        self.tp = tp or TPGroup()
        self.tracer = tracer or Tracer()
        self.device = resolve_device(cfg.device, self.tp.rank)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.dtype = resolve_dtype(cfg.dtype, self.device)
        self.backend = resolve_backend(cfg.attention_backend, self.device)
        fused = self.backend == "flashinfer"
        torch.manual_seed(cfg.seed)
        lap = Laps()
        self.kv_dtype = resolve_kv_dtype(cfg.kv_cache_dtype, self.dtype)
        self.model, self.spec = load_model(model_dir, self.dtype, self.device, self.tp,
                                           flashinfer_ops() if fused else TORCH_OPS, cfg.quantization, cfg.fp8_vocab)
        self.quant = self.model.quant
        lap("load")
        kernels = choose_kernels(self.model, self.device, self.dtype,  # (startup.py: the kernel steps, in order)
                                 fp8_paths=self.quant is not None or self.kv_dtype != self.dtype,
                                 small_m=not cfg.disable_small_m_kernel, lap=lap)
        self.context_length = cfg.context_length or self.spec.context_length
        kv_heads = self.spec.kv_heads_per_rank(self.tp.size)
        self.pool_size = cfg.max_total_tokens or self._default_pool_size(kv_heads, cfg.mem_fraction_static)
        scales = None
        if self.kv_dtype != self.dtype:
            scales = layer_scales(self.model.kv_scales, self.spec.num_layers, self.spec.num_kv_heads, self.tp.rank,
                                  self.tp.size)
        self.kv = KVPool(self.spec.num_layers, self.pool_size + 1, kv_heads, self.spec.head_dim,
                         self.dtype, self.device, kv_dtype=self.kv_dtype, scales=scales)
        self.tiers: Tiers | None = None  # the hierarchical cache's host (and disk) tier: copies between tiers
        if cfg.hicache:
            self.tiers = build_tiers(cfg, self.kv, self.pool_size, model_dir, self.tp, dict(  # (what the disk's
                arch=self.spec.architecture, layers=self.spec.num_layers, kv_heads=kv_heads,  # files must match)
                head_dim=self.spec.head_dim, dtype=str(self.dtype), kv_dtype=str(self.kv.dtype),
                quant=self.quant.name if self.quant else "", tp=(self.tp.rank, self.tp.size),
                scales=[s.tolist() for s in scales.k + scales.v] if scales else None))
        lap("pool")
        self.attn = make_backend(self.backend, self.kv, self.spec.num_heads // self.tp.size, cfg.decode_attention)
        self.sampler = TokenSampler(seed=cfg.seed, fused=flashinfer_draw() if fused else None)
        # (a row a multiple of 16 wide: Triton compiles a variant per stride class, warmed up for that one)
        self.table_width = -(-self.context_length // 16) * 16
        self.req_to_token = torch.zeros((1, self.table_width), dtype=torch.int32, device=self.device)
        self.pad_row = 0  # the table's last row: all zeros (slot 0), never a request's
        self.graphs: DecodeGraphs | None = None
        lap("attention")
        if self.device.type == "cuda" and self.attn.supports_cuda_graph and not cfg.disable_cuda_graph:
            with torch.inference_mode():
                self.graphs = DecodeGraphs(self.model, self.attn, cfg.cuda_graph_max_bs, self.context_length,
                                           self.device, self.spec.vocab_size)
        lap("cuda_graphs")
        self.pieces: PiecewiseGraphs | None = None  # eager steps' work between attentions, as graphs
        piece_tokens = cfg.piecewise_cuda_graph_max_tokens
        if piece_tokens < 0:  # auto: on with decode graphs on one GPU (unmeasured across tensor-parallel ranks)
            piece_tokens = PIECEWISE_AUTO_TOKENS if self.graphs is not None and self.tp.size == 1 else 0
        if piece_tokens > 0 and (self.graphs is not None or self.device.type == "cpu"):
            try:  # (on the CPU the pieces run eagerly in place of graphs: the same path, for tests)
                write = knobs.get("piecewise_write")  # (the rope + KV write in the graphs)
                self.pieces = PiecewiseGraphs(self.model, piece_tokens, self.device, self.dtype,
                                              capture=self.device.type == "cuda", pool=self.kv if write else None)
            except (RuntimeError, torch.cuda.OutOfMemoryError) as e:  # (a capture that fails: eager steps as before)
                if self.device.type == "cuda":
                    torch.cuda.synchronize()
                log.warning("piecewise_graphs_off", reason=f"{type(e).__name__}: {e}"[:300])
        lap("piecewise")
        self.batch_sampler = BatchSampler(self.sampler, self.spec.vocab_size, self.device)
        self.last_token = torch.zeros(1, dtype=torch.int64, device=self.device)  # by row: its last sampled token
        self.timer = DeviceTimer(self.device)
        self.busy_s = self.idle_s = 0.0  # device time of the last finished step, and the idle gap before it
        # called while an eager step is being queued (after its plan, after each layer): rank 0's worker
        # answers the step in flight there once its results are in, rather than when this launch ends
        self.between_layers: Callable[[], None] | None = None
        self.rids: dict[int, tuple[str, str, Span]] = {}  # by row: request id, trace id, ``forward`` span
        self._scores: dict = {}  # prompt-logprob fields of the last step, if it had scoring requests
        log.info("model_loaded", model=os.path.basename(model_dir.rstrip("/")), arch=self.spec.architecture,
                 device=str(self.device), dtype=str(self.dtype).removeprefix("torch."), pool_size=self.pool_size,
                 kv_cache_dtype=self.kv_cache_dtype, kv_bytes_per_token=self.kv.bytes_per_token,
                 kv_scales=scales.source if scales else None, quantization=self.quantization,
                 weight_gib=round(self.weight_bytes / 2**30, 3), kernels=kernels or None,
                 context_length=self.context_length, attention=self.backend, tp_rank=self.tp.rank,
                 tp_size=self.tp.size, cuda_graph_bs=self.graphs.batch_sizes if self.graphs else [], startup_s=lap.s,
                 kernel_map=[" · ".join(e) for e in self.attn.kernel_map()], knobs=knobs.given() or None)

    @property
    def kv_cache_dtype(self) -> str:
        """What the KV pool stores: the model dtype's name, or "fp8_e4m3"."""
        return "fp8_e4m3" if self.kv.quantized else str(self.kv.dtype).removeprefix("torch.")

    @property
    def quantization(self) -> str:
        """The weights' quantization ("" for none)."""
        return self.quant.name if self.quant is not None else ""

    @property
    def weight_bytes(self) -> int:
        """This rank's parameters (FP8 weights and their scales included), tied ones once."""
        return sum(p.numel() * p.element_size() for p in self.model.parameters())  # (tied ones once)

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
        n = pool_slots_for_memory(budget, self.spec.num_layers, kv_heads, self.spec.head_dim, self.kv_dtype)
        n = max(1, min(n - 1, 64 * self.context_length))  # slot 0 is padding
        if self.tp.size > 1:
            t = torch.tensor([n], dtype=torch.int64, device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.tp.group)
            n = int(t.item())
        return n

    def setup(self, max_rows: int) -> None:
        """Size the request table: rows 0..max_rows-1 for requests, row max_rows for padding."""
        self.req_to_token = torch.zeros((max_rows + 1, self.table_width), dtype=torch.int32, device=self.device)
        self.last_token = torch.zeros(max_rows + 1, dtype=torch.int64, device=self.device)
        self.pad_row = max_rows

    @property
    def params(self) -> dict[int, SamplingParams]:
        return self.batch_sampler.params

    def execute(self, b: ForwardBatch) -> np.ndarray:
        """Run one step; returns the sampled id per request in batch order (-1 where not sampled)."""
        return self.run_batch(b)[0]

    def run_batch(self, b: ForwardBatch, bitmask: bytes = b"") -> tuple[np.ndarray, dict]:
        """Run one step to the end → (sampled id per request in batch order, -1 where not
        sampled; the optional StepOutput fields: logprobs, prompt logprobs). On TP ranks other
        than 0 nothing is sampled: rank 0 answers the scheduler."""
        launched = self.launch(b)
        if launched.awaits_mask:
            self.sample(launched, bitmask)
        return self.finish(launched)

    @torch.inference_mode()
    def launch(self, b: ForwardBatch) -> Launched:
        """Queue the step's work on the device and return without waiting for it: the forward,
        then (unless its grammar bitmask is deferred: ``sample`` later) the sampling and the copy
        of the results to the host. ``finish`` waits for them."""
        sample = from_i32(b.emits).astype(bool)
        start = self.timer.start()
        logits = self._logits(b, all_logits=False, copy=False)
        launched = Launched(b, sample, start, logits, self._scores, kind=self._kind, rows_d=self._rows_d)
        if not launched.awaits_mask:
            self.sample(launched, b.bitmask)
        return launched

    @torch.inference_mode()
    def sample(self, launched: Launched, bitmask: bytes) -> None:
        """Sample the launched step (rank 0), make its tokens the next inputs of their rows (every
        rank), and start copying the results back."""
        b, sample = launched.batch, launched.emits
        if sample.any():
            ids = None
            if self.tp.rank == 0:
                launched.sampled = self.batch_sampler.sample(b, launched.logits, sample, bitmask)
                ids = launched.sampled.ids
            if self.tp.size > 1:  # followers feed the sampled tokens to the next step too
                if ids is None:
                    ids = torch.empty(int(sample.sum()), dtype=torch.int64, device=self.device)
                dist.broadcast(ids, src=0, group=self.tp.group)
            at = launched.rows_d if sample.all() and launched.rows_d is not None else to_device(
                from_i32(b.rows)[sample], torch.int64, self.device)  # (the step's own rows: no copy)
            self.last_token[at] = ids
        launched.logits = None
        launched.awaits_mask = False
        if self.tp.rank == 0:
            launched.host = BatchSampler.copy_back(launched.sampled, launched.scores)
        launched.end = self.timer.end()

    def finish(self, launched: Launched) -> tuple[np.ndarray, dict]:
        """Wait for a launched (and sampled) step's results → ``step``'s return value."""
        n = len(launched.emits)
        host = launched.host.get() if launched.host is not None else {}
        self.busy_s, self.idle_s = self.timer.measure(launched.start, launched.end, launched.batch.follows)
        if self.tp.rank != 0:
            return np.full(n, -1, dtype=np.int32), {}
        return BatchSampler.finish(launched.sampled, n, host)

    @torch.inference_mode()
    def forward(self, b: ForwardBatch, all_logits: bool = False) -> torch.Tensor:
        """Apply the batch's table diffs and run the model -> logits (N, V) float32 of the requests
        that sample (in batch order), or of every new token with ``all_logits``."""
        return self._logits(b, all_logits, copy=True)

    def _tier_fence(self, b: ForwardBatch) -> None:
        """The compute stream waits for the host-tier copies this step depends on (demoted slots it
        may overwrite, loads its requests read) — after the step's plan and table writes, so that
        the plan's copy is not queued behind them (see ``FlashInferBackend.prepare``)."""
        if self.tiers is not None:
            self.tiers.copier.before_forward(b.cache_ready)

    def _logits(self, b: ForwardBatch, all_logits: bool, copy: bool) -> torch.Tensor:
        """``forward``; without ``copy``, a graph step's logits may be a view of the graph's output
        buffer, valid until the next step."""
        self._admit(b)
        rows, prefix, extend = from_i32(b.rows), from_i32(b.prefix_lens), from_i32(b.extend_lens)
        ids, slots = from_i32(b.input_ids), from_i32(b.out_slots)
        sample = from_i32(b.emits).astype(bool)
        n, t = len(rows), len(ids)
        positions = np.arange(t) - np.repeat(np.cumsum(extend) - extend - prefix, extend)  # (T,)
        self._scores = {}
        eager = b.score_rows or b.cascade_group  # (graphs: no scoring positions, no shared-prefix groups)
        bs = self.graphs.size_for(n) if self.graphs is not None and t == n and not eager else None
        pieces = bs is None and self.pieces is not None and self.pieces.size_for(t) is not None
        self._kind = step_kind(extend, graph=bs is not None, pieces=pieces)
        pending = bool((ids < 0).any())  # overlap: inputs the previous step sampled, still on the device
        real = n
        if bs is not None:  # pure decode: pad to the graph's size with the padding row (its last token: 0)
            pad = bs - n
            ids = np.pad(ids, (0, pad), constant_values=-1 if pending else 0)
            slots, positions, rows, prefix = (np.pad(a, (0, pad)) for a in (slots, positions, rows, prefix))
            rows[n:] = self.pad_row
            n = t = bs
        host = np.concatenate([ids, slots, positions, rows, prefix, extend, np.repeat(rows[: len(extend)], extend)])
        dev = to_device(host, torch.int64, self.device)
        every = pending and bool((ids < 0).all())
        if bs is not None:
            inputs = self.graphs.inputs[:, :bs]
            inputs.copy_(dev[: NUM_INPUTS * bs].view(NUM_INPUTS, bs))
            self._rows_d = inputs[ROWS][:real]
            if pending:
                self._resolve(inputs[IDS], inputs[ROWS], every)
            x = self.graphs.batch(self.req_to_token, bs, prefix.tolist())
            self.req_to_token[x.rows, x.positions] = x.out_slots.to(torch.int32)
            logits = self.graphs.replay(x, lambda: self._tier_fence(b))[: len(sample)]  # the graph's output buffer
            if all_logits or sample.all():
                return logits.clone() if copy else logits
            return logits[to_device(np.flatnonzero(sample), torch.int64, self.device)]
        ids_d, slots_d, pos_d = dev[:t], dev[t : 2 * t], dev[2 * t : 3 * t]
        rows_d, prefix_d = dev[3 * t : 3 * t + n], dev[3 * t + n : 3 * t + 2 * n]
        extend_d, tok_rows_d = dev[3 * t + 2 * n : 3 * t + 3 * n], dev[3 * t + 3 * n :]
        self._rows_d = rows_d
        if pending:
            self._resolve(ids_d, tok_rows_d, every)
        self.req_to_token[tok_rows_d, pos_d] = slots_d.to(torch.int32)
        cascade = None
        if b.cascade_group:
            cascade = make_cascade(from_i32(b.cascade_group), from_i32(b.cascade_lens), rows, extend, self.device)
        batch = AttentionBatch(req_to_token=self.req_to_token, rows=rows_d, prefix_lens=prefix_d,
                               extend_lens=extend_d, out_slots=slots_d, positions=pos_d,
                               prefix_lens_cpu=prefix.tolist(), extend_lens_cpu=extend.tolist(), cascade=cascade)
        self.attn.prepare(batch)
        self._tier_fence(b)
        if self.between_layers is not None:
            self.between_layers()
        if pieces:
            hidden = self.pieces.forward(ids_d, pos_d, self.attn, self.between_layers, slots_d)  # (T, H): a view
        else:
            hidden = self.model.forward(ids_d, pos_d, self.attn, self.between_layers)  # (T, H)
        if b.score_rows:  # scoring requests: the logits of their prompt positions
            idx, targets, counts = score_positions(b)
            scored = hidden[to_device(idx, torch.int64, self.device)] if len(idx) else None
            self._scores = prompt_logprobs(self.model.compute_logits, scored, targets, counts,
                                           score_top_k(b, self.params))
        if not all_logits:
            if not sample.any():
                return hidden[:0, :0]
            last = (np.cumsum(extend) - 1)[sample]
            hidden = hidden[to_device(last, torch.int64, self.device)]
        return self.model.compute_logits(hidden)  # (N, V)

    def _resolve(self, ids: torch.Tensor, rows: torch.Tensor, every: bool) -> None:
        """Replace the -1 input ids (in place) by their row's last sampled token (``every``: all of them are -1:
        one gather)."""
        if every:
            torch.index_select(self.last_token, 0, rows, out=ids)
        else:
            ids.copy_(torch.where(ids < 0, self.last_token[rows], ids))

    def end_spans(self) -> None:
        """End the spans of requests still holding rows (stopping: a row is released with the next
        batch, which may never come)."""
        for _, _, span in self.rids.values():
            span.end()

    def _admit(self, b: ForwardBatch) -> None:
        for row in b.released_rows:
            self.batch_sampler.release(row)
            rid, trace_id, span = self.rids.pop(row, ("", "", Span("")))
            stage("worker_released", rid, trace_id=trace_id, row=row)
            span.end()
        for nr in b.new_reqs:
            trace_id = nr.traceparent[3:35]
            self.rids[nr.row] = (nr.rid, trace_id, self.tracer.start("forward", nr.traceparent, request_id=nr.rid,
                                                                      row=nr.row))
            stage("worker_admitted", nr.rid, trace_id=trace_id, row=nr.row, step=b.step_id)
            self.batch_sampler.admit(nr)
            prefix = from_i32(nr.prefix_slots)
            if len(prefix):
                self.req_to_token[nr.row, : len(prefix)] = to_device(prefix.copy(), torch.int32, self.device)
