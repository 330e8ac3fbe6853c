"""The model runner: owns the weights, the KV pool, the ``req_to_token`` mirror and the per-request
sampler state, and executes one ``ForwardBatch`` at a time. It decides nothing about requests."""

from __future__ import annotations

import os

import numpy as np
import torch

from shared.config import WorkerConfig
from shared.logging import get_logger, stage
from shared.messages.common import SamplingParams, from_i32
from shared.messages.to_worker import ForwardBatch
from services.worker.attention.base import AttentionBatch
from services.worker.attention.torch_backend import TorchAttention
from services.worker.kv_pool import KVPool, pool_slots_for_memory
from services.worker.models.layers import TPGroup
from services.worker.models.loader import load_model
from services.worker.sampling import Sampler

log = get_logger("worker")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CPU_KV_BYTES = 1 << 30  # default KV budget on CPU
GPU_MEM_FRACTION = 0.85  # of the memory left after the weights


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


class ModelRunner:
    def __init__(self, cfg: WorkerConfig, model_dir: str, tp: TPGroup | None = None) -> None:
        self.device = resolve_device(cfg.device)
        self.dtype = resolve_dtype(cfg.dtype, self.device)
        self.tp = tp or TPGroup()
        torch.manual_seed(cfg.seed)
        self.model, self.spec = load_model(model_dir, self.dtype, self.device, self.tp)
        self.context_length = cfg.context_length or self.spec.context_length
        kv_heads = self.spec.kv_heads_per_rank(self.tp.size)
        self.pool_size = cfg.max_total_tokens or self._default_pool_size(kv_heads)
        self.kv = KVPool(self.spec.num_layers, self.pool_size + 1, kv_heads, self.spec.head_dim,
                         self.dtype, self.device)
        self.attn = TorchAttention(self.kv)
        self.sampler = Sampler(seed=cfg.seed)
        self.req_to_token = torch.zeros((0, self.context_length), dtype=torch.int32, device=self.device)
        self.params: dict[int, SamplingParams] = {}  # by row
        self.gens: dict[int, torch.Generator | None] = {}
        self.rids: dict[int, str] = {}  # by row, for the stage log
        log.info("model_loaded", model=os.path.basename(model_dir.rstrip("/")), arch=self.spec.architecture,
                 device=str(self.device), dtype=str(self.dtype).removeprefix("torch."), pool_size=self.pool_size,
                 context_length=self.context_length)

    def _default_pool_size(self, kv_heads: int) -> int:
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * GPU_MEM_FRACTION)
        else:
            budget = CPU_KV_BYTES
        n = pool_slots_for_memory(budget, self.spec.num_layers, kv_heads, self.spec.head_dim, self.dtype)
        return max(1, min(n, 64 * self.context_length))

    def setup(self, max_rows: int) -> None:
        self.req_to_token = torch.zeros((max_rows, self.context_length), dtype=torch.int32, device=self.device)

    @torch.inference_mode()
    def execute(self, b: ForwardBatch) -> np.ndarray:
        """Run one step; returns the sampled id per request in batch order (-1 where not sampled)."""
        dev = self.device
        for row in b.released_rows:
            self.params.pop(row, None)
            self.gens.pop(row, None)
            stage("worker_released", self.rids.pop(row, ""), row=row)
        for nr in b.new_reqs:
            self.rids[nr.row] = nr.rid
            stage("worker_admitted", nr.rid, row=nr.row, step=b.step)
            self.params[nr.row] = nr.params
            self.gens[nr.row] = (torch.Generator(device=dev).manual_seed(nr.params.seed)
                                 if nr.params.seed is not None else None)
            prefix = torch.from_numpy(from_i32(nr.prefix_slots).copy())
            self.req_to_token[nr.row, : prefix.numel()] = prefix.to(dev)
        rows_np, prefix_np, extend_np = from_i32(b.rows), from_i32(b.prefix_lens), from_i32(b.extend_lens)
        sample_np = from_i32(b.sample).astype(bool)
        ids = torch.from_numpy(from_i32(b.input_ids).astype(np.int64)).to(dev)
        out_slots = torch.from_numpy(from_i32(b.out_slots).astype(np.int64)).to(dev)
        rows = torch.from_numpy(rows_np.astype(np.int64)).to(dev)
        prefix = torch.from_numpy(prefix_np.astype(np.int64)).to(dev)
        extend = torch.from_numpy(extend_np.astype(np.int64)).to(dev)
        # positions of the new tokens: prefix_len + 0..extend_len-1 per request   # (T,)
        starts = torch.cumsum(extend, 0) - extend
        tok_req = torch.repeat_interleave(torch.arange(len(extend_np), device=dev), extend)
        positions = prefix[tok_req] + torch.arange(ids.numel(), device=dev) - starts[tok_req]
        self.req_to_token[rows[tok_req], positions] = out_slots.to(torch.int32)
        batch = AttentionBatch(req_to_token=self.req_to_token, rows=rows, prefix_lens=prefix, extend_lens=extend,
                               out_slots=out_slots, positions=positions, prefix_lens_cpu=prefix_np.tolist(),
                               extend_lens_cpu=extend_np.tolist())
        self.attn.prepare(batch)
        hidden = self.model.forward(ids, positions, self.attn)  # (T, H)
        out = np.full(len(rows_np), -1, dtype=np.int32)
        if not sample_np.any():
            return out
        last = (starts + extend - 1)[torch.from_numpy(sample_np).to(dev)]
        logits = self.model.compute_logits(hidden[last])  # (N, V)
        sel_rows = rows_np[sample_np].tolist()
        gens = [self.gens[r] for r in sel_rows]
        next_ids = self.sampler.sample(logits, [self.params[r] for r in sel_rows], gens)
        out[sample_np] = next_ids.cpu().numpy()
        return out
