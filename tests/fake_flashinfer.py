"""A stand-in for the few FlashInfer attention APIs the worker's backend calls, in plain PyTorch,
with their documented semantics (page size 1, NHD layout, a causal mask aligned to the end of each
request's KV, log-sum-exp on request). It checks, on the CPU, that the backend plans what it means
to: the indptr arrays, page indices and masks it hands to FlashInfer. The kernels themselves are
tested on the GPU (tests/gpu)."""

from __future__ import annotations

import types

import torch

from services.worker.attention.base import merge_states


def _attend(q, k, v, causal: bool):
    """q (E, Hq, D), k/v (L, Hkv, D) → out (E, Hq, D) float32, lse (E, Hq)."""
    e, hq, d = q.shape
    hkv = k.shape[1]
    scores = torch.einsum("ekgd,lkd->ekgl", q.float().view(e, hkv, hq // hkv, d), k.float()) * d**-0.5
    if causal:
        visible = torch.arange(k.shape[0])[None, :] <= torch.arange(k.shape[0] - e, k.shape[0])[:, None]
        scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(scores, -1)
    out = torch.einsum("ekgl,lkd->ekgd", scores.softmax(-1), v.float())
    return out.reshape(e, hq, d), lse.reshape(e, hq)


class _Paged:
    def __init__(self, workspace, layout, **kw) -> None:
        assert layout == "NHD"
        self.plans = 0

    def plan(self, qo_indptr, kv_indptr, kv_indices, last_page_len, hq, hkv, d, page_size, causal=False, **kw):
        assert page_size == 1 and (last_page_len == 1).all() and len(last_page_len) == len(qo_indptr) - 1
        assert kv_indptr.device.type == "cpu" and qo_indptr.device.type == "cpu"  # the planner reads the host
        self.qo, self.kv, self.indices, self.causal = qo_indptr.tolist(), kv_indptr.tolist(), kv_indices, causal
        assert len(kv_indices) == self.kv[-1]
        self.plans += 1

    def run(self, q, paged_kv, out=None, lse=None, return_lse=False):
        """As FlashInfer's: ``out`` / ``lse`` given are written (their shape and dtype checked) and returned."""
        k_cache, v_cache = paged_kv
        o = torch.empty(q.shape, dtype=torch.float32)
        s = torch.empty(q.shape[:2])
        for i in range(len(self.qo) - 1):
            qs, ks = slice(self.qo[i], self.qo[i + 1]), self.indices[self.kv[i]:self.kv[i + 1]].long()
            o[qs], s[qs] = _attend(q[qs], k_cache[ks], v_cache[ks], self.causal)
        if out is None:
            out = o.to(q.dtype)
        else:
            assert out.shape == q.shape and out.dtype == q.dtype, (out.shape, out.dtype)
            out.copy_(o)
        if lse is None:
            lse = s
        else:
            assert return_lse and lse.shape == q.shape[:2] and lse.dtype == torch.float32
            lse.copy_(s)
        return (out, lse) if return_lse else out


class _Decode(_Paged):
    def plan(self, indptr, indices, last_page_len, hq, hkv, d, page_size, **kw):
        n = len(indptr) - 1
        super().plan(torch.arange(n + 1, dtype=torch.int32), indptr, indices, last_page_len, hq, hkv, d, page_size)


class _Ragged:
    def __init__(self, workspace, layout, **kw) -> None:
        pass

    def plan(self, qo_indptr, kv_indptr, hq, hkv, d, causal=False, **kw):
        self.qo, self.kv, self.causal = qo_indptr.tolist(), kv_indptr.tolist(), causal

    def run(self, q, k, v, return_lse=False):
        out = torch.empty(q.shape, dtype=torch.float32)
        for i in range(len(self.qo) - 1):
            qs, ks = slice(self.qo[i], self.qo[i + 1]), slice(self.kv[i], self.kv[i + 1])
            out[qs] = _attend(q[qs], k[ks], v[ks], self.causal)[0]
        return out.to(q.dtype)


def merge_state_in_place(v, s, v_other, s_other):
    out, lse = merge_states(v, s, v_other, s_other)
    v.copy_(out)
    s.copy_(lse)


def module() -> types.ModuleType:
    m = types.ModuleType("flashinfer")
    m.BatchDecodeWithPagedKVCacheWrapper = _Decode
    m.BatchPrefillWithPagedKVCacheWrapper = _Paged
    m.BatchPrefillWithRaggedKVCacheWrapper = _Ragged
    m.merge_state_in_place = merge_state_in_place
    return m
