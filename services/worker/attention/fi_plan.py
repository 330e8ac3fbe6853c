"""Page tables and plans for FlashInfer's paged kernels (page size 1), apart from the backend that uses them
(``flashinfer_backend``): the slots a batch's requests read, gathered on the device; the indptr arrays, on the
host where FlashInfer's planner reads them; and the tensor-core (FA2) decode planner's one call, which the
backend makes itself where ``wrapper.plan`` would add a host loop over the batch."""

from __future__ import annotations

import numpy as np
import torch

from services.worker.hostio import to_device


def kv_indices(
    req_to_token: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor, total: int,
    out: torch.Tensor | None = None, starts: torch.Tensor | None = None,
) -> torch.Tensor:
    """Slots of positions 0..seq_lens[i]-1 (``starts[i]``..``starts[i]``+seq_lens[i]-1 with
    ``starts``) of each row ``rows[i]``, concatenated: (total,) int32 (into ``out`` when given).

    rows, seq_lens, starts (B,) int64 on the table's device; ``total`` (the sum of seq_lens) is
    known on the host, so nothing here waits for the device.
    """
    device = req_to_token.device
    row_start = rows * req_to_token.stride(0) - (torch.cumsum(seq_lens, 0) - seq_lens)  # (B,) flat offset - kv start
    if starts is not None:
        row_start = row_start + starts
    flat = torch.repeat_interleave(row_start, seq_lens, output_size=total) + torch.arange(total, device=device)
    return torch.index_select(req_to_token.view(-1), 0, flat, out=out)


def indptr(lengths: np.ndarray) -> torch.Tensor:  # (B,) -> (B + 1,) int32 on the host
    out = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=out[1:])
    return torch.from_numpy(out)


def fa2_decode_plan(wrapper, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, seq_lens: np.ndarray,
                    heads: tuple[int, int, int], graph: bool) -> list:
    """The FA2 decode planner's call as ``wrapper.plan`` makes it for one token a request (the pinned FlashInfer's
    argument order) → the plan info. ``graph``: a CUDA graph's (split sizes fixed at capture)."""
    n, (hq, hkv, d) = len(seq_lens), heads
    return wrapper._cached_module.plan(
        wrapper._float_workspace_buffer, wrapper._int_workspace_buffer, wrapper._pin_memory_int_workspace_buffer,
        qo_indptr, kv_indptr, torch.from_numpy(seq_lens.astype(np.int32)), n, n, hq, hkv, 1, graph, d, d, False,
        -1, -1, False, 0, 0,  # (the rest as ``wrapper.plan`` passes it for a plain decode)
    )


class EagerDecodePlans:
    """An eager tensor-core (FA2) decode planned without ``wrapper.plan``'s per-call Python: the planner's one
    call (``fa2_decode_plan``), then the buffers ``wrapper.run`` reads set on the wrapper as ``plan`` sets them
    (the pinned FlashInfer's fields; the backend falls back to ``plan`` if this raises)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._grow(256)

    def _grow(self, n: int) -> None:
        self._rows_host = torch.arange(n + 1, dtype=torch.int32)  # qo_indptr of one token a row
        self._rows_dev = self._rows_host.to(self.device)
        self._ones_dev = torch.ones(n, dtype=torch.int32, device=self.device)  # last_page_len

    def plan(self, wrapper, seq_lens: np.ndarray, kv_indptr: torch.Tensor, indices: torch.Tensor,
             heads: tuple[int, int, int]) -> None:
        n = len(seq_lens)
        if n + 1 > self._rows_host.numel():
            self._grow(2 * n)
        info = fa2_decode_plan(wrapper, self._rows_host[: n + 1], kv_indptr, seq_lens, heads, graph=False)
        wrapper._paged_kv_indptr_buf = to_device(kv_indptr.numpy(), torch.int32, self.device)
        wrapper._paged_kv_indices_buf = indices
        wrapper._paged_kv_last_page_len_buf = self._ones_dev[:n]  # (its size is the batch size to ``run``)
        wrapper._qo_indptr_buf = self._rows_dev[: n + 1]
        wrapper._batch_size, wrapper._max_kv_len, wrapper._plan_info = n, int(seq_lens.max()), info
