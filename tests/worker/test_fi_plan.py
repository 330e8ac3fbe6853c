"""``fi_plan``: the page-table gather and the eager FA2 decode plan the flashinfer backend makes without
``wrapper.plan`` (the wrapper's fields set as the pinned FlashInfer's ``plan`` sets them; the planner's call
with its argument order). On the GPU the plans run through FlashInfer's kernels (tests/gpu/test_gpu_parity.py)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from services.worker.attention.fi_plan import EagerDecodePlans, indptr, kv_indices


class _Module:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def plan(self, *args):
        self.calls.append(args)
        return [7, len(self.calls)]  # (a plan info: what ``run`` later reads from the wrapper)


def _wrapper() -> SimpleNamespace:
    return SimpleNamespace(_cached_module=_Module(), _float_workspace_buffer="f", _int_workspace_buffer="i",
                           _pin_memory_int_workspace_buffer="p")


def test_eager_decode_plan_sets_what_run_reads_and_grows() -> None:
    plans, w = EagerDecodePlans(torch.device("cpu")), _wrapper()
    table = torch.arange(4 * 10, dtype=torch.int32).view(4, 10)
    for n in (3, 300):  # (300: past the initial 256 rows, the buffers grow)
        seq_lens = (np.arange(n) % 7 + 1).astype(np.int64)
        rows = torch.arange(n) % 4
        kv_ptr = indptr(seq_lens)
        idx = kv_indices(table, rows, torch.from_numpy(seq_lens), int(seq_lens.sum()))
        plans.plan(w, seq_lens, kv_ptr, idx, (32, 8, 128))
        args = w._cached_module.calls[-1]
        assert args[:3] == ("f", "i", "p") and args[3].tolist() == list(range(n + 1))  # qo_indptr: a token a row
        assert args[4] is kv_ptr and args[5].tolist() == seq_lens.tolist() and args[6:13] == (n, n, 32, 8, 1, False,
                                                                                                128)
        assert w._batch_size == n and w._max_kv_len == min(n, 7) and w._plan_info == [7, len(w._cached_module.calls)]
        assert w._qo_indptr_buf.tolist() == list(range(n + 1)) and w._paged_kv_last_page_len_buf.tolist() == [1] * n
        assert w._paged_kv_indptr_buf.tolist() == kv_ptr.tolist() and w._paged_kv_indices_buf is idx
        assert idx[: seq_lens[0]].tolist() == table[0, : seq_lens[0]].tolist()
