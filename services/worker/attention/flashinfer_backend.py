"""FlashInfer attention over the same paged KV pool as the torch backend.

Page size 1: each layer's (num_slots, Hkv, D) K and V tensors are read as an NHD paged cache of
num_slots one-token pages, and a request's page list is its ``req_to_token`` row. Each step gets
one of three plans:

- every request decodes one token → ``BatchDecodeWithPagedKVCacheWrapper`` (tensor cores when the
  GQA group is >= 4); under CUDA graphs, one wrapper per captured batch size on fixed buffers;
- no request has KV before this step (fresh prompts only) → ``BatchPrefillWithRaggedKVCacheWrapper``
  over the new tokens' own K/V, nothing gathered from the pool;
- otherwise (a cached prefix) → a causal ``BatchPrefillWithPagedKVCacheWrapper`` plan over
  prefix + new tokens; decodes mixed with prefill chunks are split in two plans, the decode rows
  through the decode wrapper and the chunks through the paged prefill (``_plan_own``);
- with shared-prefix groups (``AttentionBatch.cascade``), two levels: each group's new tokens
  against its shared prefix, read once (a non-causal paged prefill plan, ``shared``), and each
  request against the rest of its KV (the decode or paged plan above, minus the shared part), both
  returning their log-sum-exp; FlashInfer's ``merge_state_in_place`` combines them. Never under
  CUDA graphs (the runner runs such steps eagerly).

Page indices are gathered on the device from the table rows (``kv_indices``); the indptr arrays
are built on the host from the lengths the batch already carries there, which is where
FlashInfer's planner reads them (so planning never waits for the device).

An FP8 pool (``--kv-cache-dtype fp8_e4m3``) is planned with ``kv_data_type`` e4m3 and the model
dtype for queries (FlashInfer's FP8-KV kernels: decode with or without tensor cores, FA2 paged
prefill); every ``run`` that reads the pool gets the layer's ``k_scale`` / ``v_scale`` (FlashInfer
folds k_scale into the softmax scale and multiplies the output by v_scale). Per-head scales, which
its kernels do not take, scale q before and the output after instead. The ragged plan reads the
new tokens' own K/V, never the pool, so it takes no scales.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from services.worker.attention import triton_decode
from services.worker.attention.base import AttentionBackend, AttentionBatch
from services.worker.attention.decode_rules import mixed_decode_triton, triton_rows_up_to
from services.worker.attention.fi_plan import EagerDecodePlans, fa2_decode_plan, kv_indices
from services.worker.attention.fi_plan import indptr as _indptr
from services.worker.hostio import to_device
from services.worker.kv_pool import KVPool
from shared.logging import get_logger

log = get_logger("worker")

WORKSPACE_BYTES = 256 << 20  # FlashInfer's float workspace (split-KV partial results), shared by all plans

Run = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class FlashInferAttention(AttentionBackend):
    supports_cuda_graph = True

    def __init__(
        self,
        pool: KVPool,
        num_q_heads: int,
        *,
        prefill_backend: str = "auto",  # FlashInfer's choice: FA3 on Hopper, else FA2
        decode_tensor_cores: bool | None = None,  # None: when the GQA group is >= 4
        decode_backend: str = "auto",  # tensor-core decode: FA2 (auto) or FA3
        shared_backend: str = "fa2",  # the shared-prefix level of cascade steps
        decode_kernel: str = "flashinfer",  # "triton": every decode plan through ``triton_decode``; "auto": below
    ) -> None:
        import flashinfer

        self._fi = flashinfer
        self.pool = pool
        _, self.num_kv_heads, self.head_dim = pool.k[0].shape
        self.num_q_heads = num_q_heads
        group = num_q_heads // self.num_kv_heads
        self.tensor_cores = group >= 4 if decode_tensor_cores is None else decode_tensor_cores
        self._triton_up_to = triton_rows_up_to(decode_kernel, pool.device.type, pool.quantized)
        self._mixed_triton = mixed_decode_triton(decode_kernel, pool.quantized)
        self._f16 = pool.quantized  # (Triton, FP8 pool: products in fp16 — e4m3 widens to it in one instruction)
        self._sm_scale = self.head_dim ** -0.5
        if self._triton_up_to and pool.device.type == "cuda":  # (each variant compiles on its first launch: now)
            try:
                triton_decode.warm_up(pool.compute_dtype, pool.dtype, (num_q_heads, self.num_kv_heads,
                                                                       self.head_dim), pool.device, f16=self._f16)
            except Exception as e:  # (e.g. a GPU Triton's dot does not take): "auto" keeps FlashInfer's decode
                if decode_kernel != "auto":
                    raise
                log.warning("triton_decode_unavailable", reason=f"{type(e).__name__}: {e}"[:300])
                self._triton_up_to = 0
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=pool.device)
        self.decode_backend = decode_backend if self.tensor_cores else "auto"
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=self.tensor_cores, backend=self.decode_backend
        )
        self.paged = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD", backend=prefill_backend)
        self.ragged = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(self.workspace, "NHD", backend=prefill_backend)
        # the shared level: a few groups of (members x GQA group) query rows against a long prefix; FA3
        # leaves its 128-row tiles mostly empty there, FA2 runs it 3.3x faster (H200)
        self.shared = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD", backend=shared_backend)
        self._graph_decode: dict[int, object] = {}  # batch size -> wrapper on fixed buffers
        self._graph_plan_info: dict[int, list] = {}  # batch size -> FlashInfer's plan at capture
        self._fast_replan = self.tensor_cores and self.decode_backend in ("auto", "fa2")
        self._fast_eager = self._fast_replan  # eager decode plans without the wrapper's per-call Python
        self._planned_once: set[int] = set()  # wrappers (id) through one full ``plan`` already
        self._fa2_eager = EagerDecodePlans(pool.device)
        self._ones = torch.ones(256, dtype=torch.int32)  # host: last_page_len (every page holds 1 token)
        self._heads = (num_q_heads, self.num_kv_heads, self.head_dim)
        self._dtypes = dict(q_data_type=pool.compute_dtype, kv_data_type=pool.dtype)
        self._scales = pool.kernel_scales(num_q_heads) if pool.quantized else None  # per layer
        self._scale_kw: dict[str, float] = {}  # the current layer's, for the runs that read the pool
        self._reads_pool = True
        self._rope_in_decode = False  # the plan's decode does the rope and the K/V write (``_rope_new``)
        self._out_slots = torch.empty(0, dtype=torch.int64, device=pool.device)
        self._run: Run = self._run_ragged
        self._last_plan: torch.cuda.Event | None = None  # after the last plan's copy to the device

    def kernel_map(self) -> list:
        """Which kernel each kind of step runs, by rows (``kernel_map.attention_map``: these rules as a table)."""
        from services.worker.attention.kernel_map import attention_map

        return attention_map("flashinfer", str(self.pool.dtype).removeprefix("torch."), self._triton_up_to,
                             self._mixed_triton, self.tensor_cores, triton_decode.MAX_PAIRS // self.num_kv_heads)

    def triton_rows(self, rows: int) -> bool:
        """Whether a decode plan of ``rows`` requests goes through ``triton_decode`` (``triton_rows_up_to``)."""
        return rows <= self._triton_up_to and rows * self.num_kv_heads <= triton_decode.MAX_PAIRS

    # --- per step ------------------------------------------------------------------------------
    # A FlashInfer plan is written on the host into its wrapper's pinned buffer, and the copy that
    # takes it to the device is queued on the stream; nothing waits for that copy. With overlap
    # scheduling step N+1 is planned while step N is queued, and N's copy can run late (N's stream
    # may wait for host-tier copies first): planning N+1 must not overwrite the buffer before N's
    # copy has read it — else N runs with N+1's plan (seen on the H200: a 98-s hang, then an illegal
    # memory access). So each plan waits for the previous one's copy (normally done long since).
    def prepare(self, batch: AttentionBatch) -> None:
        self._plan_fence()
        self._prepare(batch)
        self._planned()

    def prepare_graph(self, batch: AttentionBatch, bs: int) -> None:
        self._plan_fence()
        self._prepare_graph(batch, bs)
        self._planned()

    def _plan_fence(self) -> None:
        if self._last_plan is not None:
            self._last_plan.synchronize()
            self._last_plan = None

    def _planned(self) -> None:
        if self.pool.device.type == "cuda":
            self._last_plan = torch.cuda.Event()
            self._last_plan.record()

    def _prepare(self, batch: AttentionBatch) -> None:
        self._out_slots, self._rope_in_decode = batch.out_slots, False
        self._reads_pool = True
        prefix = np.asarray(batch.prefix_lens_cpu, dtype=np.int64)
        extend = np.asarray(batch.extend_lens_cpu, dtype=np.int64)
        if batch.cascade is not None:
            self._plan_cascade(batch, prefix, extend)
        elif batch.is_decode:
            self._plan_decode(batch, self.decode)
        elif not prefix.any():
            qo_indptr = _indptr(extend)
            self.ragged.plan(qo_indptr, qo_indptr, *self._heads, causal=True, q_data_type=self.pool.compute_dtype)
            self._run, self._reads_pool = self._run_ragged, False
        else:
            own = self._plan_own(batch, prefix, extend, None, lse=False)
            self._run = lambda q, k, v, k_cache, v_cache: own(q, (k_cache, v_cache))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, rope=None,
                written: bool = False) -> torch.Tensor:
        if not written and rope is not None and self._rope_in_decode \
                and (new := self._rope_new(layer, q, k, v, rope)) is not None:
            return self._run(q, k, v, self.pool.k[layer], self.pool.v[layer], new=new)  # (rotates, writes, attends)
        q, k = self._write(layer, q, k, v, rope, written)
        k_cache, v_cache = self.pool.k[layer], self.pool.v[layer]  # (S, Hkv, D)
        if self._scales is None or not self._reads_pool:
            return self._run(q, k, v, k_cache, v_cache)  # (T, Hq, D)
        self._scale_kw, q_mul, o_mul = self._scales[layer]
        out = self._run(q if q_mul is None else q * q_mul, k, v, k_cache, v_cache)
        return out if o_mul is None else out * o_mul

    def _rope_new(self, layer: int, q, k, v, rope) -> tuple | None:
        """``triton_decode.decode``'s ``new`` for this layer (it then does the rope and the K/V write), or None."""
        scales = None if self._scales is None else self._scales[layer]
        if scales is not None and scales[1] is not None:
            return None  # (per-head FP8 scales multiply q before the attention: the rope first, apart)
        if (args := self.pool.rope_args(layer, q, k, v, rope)) is None:
            return None
        if scales is not None:
            self._scale_kw = scales[0]
        cos_sin, positions, k_inv, v_inv = args
        return k, v, cos_sin, positions, self._out_slots, k_inv, v_inv

    def _plan_own(self, batch: AttentionBatch, prefix: np.ndarray, extend: np.ndarray, skip: np.ndarray | None,
                  lse: bool) -> Callable:
        """Each request's new tokens against its KV from position ``skip`` (0: all of it), causal →
        ``run(q, (k_cache, v_cache))`` (with ``lse``: also the log-sum-exp). All decodes: the decode
        plan. Decodes mixed with prefill chunks: split in two (one paged prefill plan over both measured slower,
        docs/decisions/0004-mixed-steps-as-one-plan.md) — the decode rows through the decode plan (tensor-core
        FA2), the chunks through the paged prefill plan (FA3 on Hopper) — as the
        prefill kernel takes many one-token rows at a fraction of the decode kernel's speed (FA3 decode
        at batch 64 × 1k: 15.6 ms a step against 7.9)."""
        dev = self.pool.device
        if skip is None:
            skip = np.zeros_like(prefix)
        own = prefix + extend - skip
        decode = extend == 1
        if decode.all() or not decode.any():
            return self._plan_part(batch, batch.rows, own, extend, skip, decode.all(), lse)
        rows_d, rows_p = np.flatnonzero(decode), np.flatnonzero(~decode)
        starts = np.cumsum(extend) - extend
        n = extend[rows_p]
        tok_p = np.repeat(starts[rows_p], n) + np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
        tok_d, tok_p = to_device(starts[rows_d], torch.int64, dev), to_device(tok_p, torch.int64, dev)
        run_d = self._plan_part(batch, batch.rows[to_device(rows_d, torch.int64, dev)], own[rows_d],
                                extend[rows_d], skip[rows_d], True, lse, mixed=True)
        run_p = self._plan_part(batch, batch.rows[to_device(rows_p, torch.int64, dev)], own[rows_p], n,
                                skip[rows_p], False, lse)

        def gathered(q, kv):
            parts = [(tok_d, run_d(q.index_select(0, tok_d), kv)), (tok_p, run_p(q.index_select(0, tok_p), kv))]
            if not lse:
                out = torch.empty_like(q, memory_format=torch.contiguous_format)
                for idx, o in parts:
                    out.index_copy_(0, idx, o)
                return out
            out = torch.empty(q.shape, dtype=parts[0][1][0].dtype, device=q.device)
            lse_out = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
            for idx, (o, s) in parts:
                out.index_copy_(0, idx, o)
                lse_out.index_copy_(0, idx, s)
            return out, lse_out

        nd = len(rows_d)

        def in_place(q, kv):  # the decodes first (the scheduler's order): q's first nd rows are theirs
            q = q.contiguous()  # (eager steps: a view of the q/k/v output — one copy, not a gather for each part)
            out = torch.empty_like(q)  # (each part writes its own rows: no gather of q, no scatter of the results)
            lse_out = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device) if lse else None
            for part, rows in ((run_d, slice(0, nd)), (run_p, slice(nd, None))):
                part(q[rows], kv, out=out[rows], lse_out=None if lse_out is None else lse_out[rows])
            return (out, lse_out) if lse else out

        return in_place if rows_d[-1] == nd - 1 else gathered

    def _plan_part(self, batch: AttentionBatch, rows: torch.Tensor, own: np.ndarray, extend: np.ndarray,
                   skip: np.ndarray, decode: bool, lse: bool, mixed: bool = False) -> Callable:
        """One plan (decode, or causal paged prefill) over the requests at table rows ``rows`` (``mixed``: a
        mixed step's decode part)."""
        dev, n = self.pool.device, len(own)
        starts = to_device(skip, torch.int64, dev) if skip.any() else None
        if decode and self.triton_rows(n) and (self._mixed_triton or not mixed):
            # (the last position each reads: skip + own - 1)
            run = self._triton_run(batch.req_to_token, rows, to_device(skip + own - 1, torch.int64, dev), starts, lse)
            return lambda q, kv, out=None, lse_out=None: run(q, None, None, kv[0], kv[1], out=out, lse_out=lse_out)
        indices = kv_indices(batch.req_to_token, rows, to_device(own, torch.int64, dev), int(own.sum()),
                             starts=starts)
        wrapper = self.decode if decode else self.paged
        if decode:
            self._plan_eager_decode(self.decode, own, indices)
        else:
            self.paged.plan(_indptr(extend), _indptr(own), indices, self._last_page_len(n), *self._heads, 1,
                            causal=True, **self._dtypes)
        # (q strided: FA2/FA3 take it; ``out``/``lse_out``: written there — else FlashInfer's paged prefill
        # allocates its output zero-filled)
        return lambda q, kv, out=None, lse_out=None: wrapper.run(q, kv, out=out, lse=lse_out, return_lse=lse,
                                                                 **self._scale_kw)

    def _plan_cascade(self, batch: AttentionBatch, prefix: np.ndarray, extend: np.ndarray) -> None:
        c, dev = batch.cascade, self.pool.device
        level1 = self._plan_own(batch, prefix, extend, c.skip, lse=True)
        shared = kv_indices(batch.req_to_token, to_device(c.first_rows, torch.int64, dev),
                            to_device(c.lens, torch.int64, dev), int(c.lens.sum()))
        self.shared.plan(_indptr(c.qo_lens), _indptr(c.lens), shared, self._last_page_len(len(c.lens)),
                         *self._heads, 1, causal=False, **self._dtypes)
        idx, m = c.q_index_dev, c.leading

        def run(q, k, v, k_cache, v_cache) -> torch.Tensor:
            out, lse = level1(q, (k_cache, v_cache))
            if m:  # the members first (the scheduler orders them so): views, merged in place
                o0, lse0 = self.shared.run(q[:m].contiguous(), (k_cache, v_cache), return_lse=True, **self._scale_kw)
                self._fi.merge_state_in_place(out[:m], lse[:m], o0, lse0)
                return out
            o0, lse0 = self.shared.run(q.index_select(0, idx), (k_cache, v_cache), return_lse=True, **self._scale_kw)
            o1, lse1 = out.index_select(0, idx), lse.index_select(0, idx)
            self._fi.merge_state_in_place(o1, lse1, o0, lse0)
            return out.index_copy_(0, idx, o1)

        self._run = run

    # --- CUDA graphs ---------------------------------------------------------------------------
    def init_graph(self, batch_sizes: list[int], max_context: int) -> None:
        max_bs, dev = max(batch_sizes), self.pool.device
        self._range = torch.arange(max_bs + 1, dtype=torch.int32)  # host: qo_indptr of one token per request
        self._g_indptr = torch.zeros(max_bs + 1, dtype=torch.int32, device=dev)
        self._g_last_page_len = torch.ones(max_bs, dtype=torch.int32, device=dev)
        # the page table's slots (FlashInfer's graphs: flat; Triton's: the batch's table rows, ``_g_width`` apart)
        self._g_width = -(-max_context // 16) * 16
        self._g_indices = torch.zeros(max_bs * self._g_width, dtype=torch.int32, device=dev)
        self._g_rows = torch.arange(max_bs, dtype=torch.int64, device=dev)
        for bs in (b for b in batch_sizes if not self.triton_rows(b)):
            self._graph_decode[bs] = self._fi.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=self.tensor_cores,
                backend=self.decode_backend,
                paged_kv_indptr_buffer=self._g_indptr[: bs + 1], paged_kv_indices_buffer=self._g_indices,
                paged_kv_last_page_len_buffer=self._g_last_page_len[:bs],
            )

    def _prepare_graph(self, batch: AttentionBatch, bs: int) -> None:
        assert batch.num_reqs == bs, "the runner pads graph batches to the captured size"
        self._out_slots, self._reads_pool = batch.out_slots, True
        self._rope_in_decode = self.triton_rows(bs) and triton_decode.rope_enabled()
        if self.triton_rows(bs):  # the batch's table rows into the fixed buffer (the graph never reads the table)
            table = self._g_indices[: bs * self._g_width].view(bs, self._g_width)
            n = max(batch.prefix_lens_cpu) + 1
            table[:, :n] = batch.req_to_token[batch.rows, :n]  # (one gather, one copy: no page list to build)
            self._run = self._triton_run(table, self._g_rows[:bs], batch.prefix_lens)
            return
        wrapper = self._graph_decode[bs]
        if self._fast_replan and bs in self._graph_plan_info:
            try:
                return self._replan(batch, wrapper)
            except Exception as e:  # a FlashInfer other than the pinned one: its own plan() from now on
                self._fast_replan = False
                log.warning("flashinfer_fast_replan_off", reason=f"{type(e).__name__}: {e}")
        self._plan_decode(batch, wrapper)
        self._graph_plan_info[bs] = list(wrapper._plan_info)

    def _replan(self, batch: AttentionBatch, wrapper) -> None:
        """What ``wrapper.plan`` does for a graph's tensor-core (FA2) decode, without its per-call
        Python (a host loop over the batch among it): the page table into the fixed buffers, then
        the planner's one call. The captured kernels read only those buffers and the workspace; the
        plan must come out as at capture (FlashInfer's graph mode keeps it fixed), else we stop."""
        bs = batch.num_reqs
        seq_lens = np.asarray(batch.prefix_lens_cpu, dtype=np.int32) + 1
        indptr = _indptr(seq_lens)
        total = int(indptr[-1])
        kv_indices(batch.req_to_token, batch.rows, batch.prefix_lens + 1, total,
                   out=wrapper._paged_kv_indices_buf[:total])
        # (from pinned memory: a pageable source may make the copy wait for the step in flight)
        wrapper._paged_kv_indptr_buf.copy_(indptr.pin_memory(), non_blocking=True)  # last_page_len: fixed ones
        info = fa2_decode_plan(wrapper, self._range[: bs + 1], indptr, seq_lens, self._heads, graph=True)
        if list(info) != self._graph_plan_info[bs]:
            raise RuntimeError("the plan differs from the captured one")

    # --- helpers -------------------------------------------------------------------------------
    def _plan_decode(self, batch: AttentionBatch, wrapper) -> None:
        if self.triton_rows(batch.num_reqs):
            self._run = self._triton_run(batch.req_to_token, batch.rows, batch.prefix_lens)
            self._rope_in_decode = triton_decode.rope_enabled()
            return
        seq_lens = np.asarray(batch.prefix_lens_cpu, dtype=np.int64) + 1
        indices = kv_indices(batch.req_to_token, batch.rows, batch.prefix_lens + 1, int(seq_lens.sum()))
        if wrapper is self.decode:
            self._plan_eager_decode(wrapper, seq_lens, indices)
        else:  # (a graph's wrapper: planned in full once, then by ``_replan``)
            wrapper.plan(_indptr(seq_lens), indices, self._last_page_len(batch.num_reqs), *self._heads, 1,
                         **self._dtypes)
        self._run = lambda q, k, v, k_cache, v_cache: wrapper.run(q, (k_cache, v_cache), **self._scale_kw)  # q: strided

    def _plan_eager_decode(self, wrapper, seq_lens: np.ndarray, indices: torch.Tensor) -> None:
        """``wrapper.plan`` of an eager decode (not a graph's). After its first full plan, the
        tensor-core (FA2) decode is planned as ``_replan`` does a graph's: the page table into the
        wrapper, then the planner's one call — ``plan`` itself takes the longest context with
        Python's ``max`` over a tensor, a host loop over the batch (~3 ms at 1,024 rows: W3's
        eager shared-prefix steps, whose host work bounds them)."""
        n, indptr = len(seq_lens), _indptr(seq_lens)
        if self._fast_eager and id(wrapper) in self._planned_once and getattr(wrapper, "_backend", "") == "fa2":
            try:
                return self._fa2_eager.plan(wrapper, seq_lens, indptr, indices, self._heads)
            except Exception as e:  # a FlashInfer other than the pinned one: its own plan() from now on
                self._fast_eager = False
                log.warning("flashinfer_fast_plan_off", reason=f"{type(e).__name__}: {e}")
        wrapper.plan(indptr, indices, self._last_page_len(n), *self._heads, 1, **self._dtypes)
        self._planned_once.add(id(wrapper))

    def _triton_run(self, table: torch.Tensor, rows: torch.Tensor, last: torch.Tensor,
                    starts: torch.Tensor | None = None, lse: bool = False) -> Run:
        """Decode rows through ``triton_decode`` (positions ``starts``..``last`` of each row ``rows`` of ``table``),
        the layer's scales applied by the kernel."""

        def run(q, k, v, k_cache, v_cache, new=None, out=None, lse_out=None):
            kw = self._scale_kw
            return triton_decode.decode(q, k_cache, v_cache, table, rows, last, self._sm_scale, kw.get("k_scale", 1.0),
                                        kw.get("v_scale", 1.0), return_lse=lse, starts=starts, f16=self._f16,
                                        new=new, out=out, lse_out=lse_out)

        return run

    def _last_page_len(self, n: int) -> torch.Tensor:
        if n > self._ones.numel():
            self._ones = torch.ones(2 * n, dtype=torch.int32)
        return self._ones[:n]

    def _run_ragged(self, q, k, v, k_cache, v_cache) -> torch.Tensor:
        return self.ragged.run(q, k, v)  # (strided views of the qkv output: the kernels take their strides)
