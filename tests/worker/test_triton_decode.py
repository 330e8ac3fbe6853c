"""The Triton split-KV decode attention (``attention/triton_decode.py``) in Triton's interpreter on the CPU
against the PyTorch reference math: table rows out of order, contexts of 1 token to several blocks, every
split count (empty splits included), per-layer K/V scales, a strided q, a graph's flat slot list, a cascade
step's own level (positions from ``starts``) and its log-sum-exp (base 2, as FlashInfer's), products in fp16,
the split counts in use and the warm-up's launches of them; the parts merged by each pair's last program (all
at once, or a few at a time for a large GQA group), its count left zero. float32 caches here (the
interpreter's fp8 emulation does not round as the GPU does); the FP8 pool on the GPU:
benchmarks/gpu/fp8_decode_bench.py (against FlashInfer on the same cache). Skipped visibly where Triton is not
installed."""

from __future__ import annotations

import pytest
import torch

from shared import knobs as registry
from tests.support import run_in_triton_interpreter

SCRIPT = r"""
import math
import torch
from services.worker.attention import triton_decode as td

g = torch.Generator().manual_seed(0)
hq, hkv, d, S = 8, 2, 24, 700  # GQA group 4, head_dim not a power of two
kc, vc = torch.randn(S, hkv, d, generator=g), torch.randn(S, hkv, d, generator=g)
lens = [0, 5, 70, 130, 257]  # prefix lengths (the context is one more)
table = torch.zeros(6, 300, dtype=torch.int32)
perm = torch.randperm(S - 1, generator=g) + 1
used = 0
for i, n in enumerate(lens):
    table[i, :n + 1] = perm[used:used + n + 1].to(torch.int32)
    used += n + 1
rows = torch.tensor([3, 0, 4, 1, 2])
prefix = torch.tensor([lens[r] for r in rows.tolist()])
q = torch.randn(5, hq, d, generator=g)


def ref(q, ks, vs, starts=None):
    return ref_with(q, kc, vc, ks, vs, starts, lse=True)


def ref_with(q, kc, vc, ks, vs, starts=None, lse=False):
    outs, lses = [], []
    for b in range(len(rows)):
        lo = 0 if starts is None else int(starts[b])
        sl = table[rows[b], lo:int(prefix[b]) + 1].long()
        k = kc[sl].repeat_interleave(hq // hkv, 1) * ks
        v = vc[sl].repeat_interleave(hq // hkv, 1) * vs
        s = torch.einsum("hd,nhd->hn", q[b], k) / math.sqrt(d)
        outs.append(torch.einsum("hn,nhd->hd", s.softmax(-1), v))
        lses.append(torch.logsumexp(s, -1) / math.log(2))
    return (torch.stack(outs), torch.stack(lses)) if lse else torch.stack(outs)


for splits in (1, 3, 16):
    for ks, vs in ((1.0, 1.0), (0.5, 2.0)):
        o, lse = td.decode(q, kc, vc, table, rows, prefix, 1 / math.sqrt(d), ks, vs, splits=splits, return_lse=True)
        ro, rl = ref(q, ks, vs)
        assert torch.allclose(o, ro, atol=1e-4, rtol=1e-4), (splits, (o - ro).abs().max())
        assert torch.allclose(lse, rl, atol=1e-4, rtol=1e-4), (splits, (lse - rl).abs().max())
for splits, part in ((4, 64), (16, 100)):  # parts of at least ``part`` tokens: short contexts' later splits empty
    o, lse = td.decode(q, kc, vc, table, rows, prefix, 1 / math.sqrt(d), splits=splits, return_lse=True, min_part=part)
    ro, rl = ref(q, 1.0, 1.0)
    assert torch.allclose(o, ro, atol=1e-4, rtol=1e-4) and torch.allclose(lse, rl, atol=1e-4, rtol=1e-4), (splits, part)
wide = torch.randn(5, 2 * hq, d, generator=g)
o = td.decode(wide[:, ::2], kc, vc, table, rows, prefix, 1 / math.sqrt(d), splits=4)  # q strided by heads
assert torch.allclose(o, ref(wide[:, ::2].contiguous(), 1.0, 1.0)[0], atol=1e-4, rtol=1e-4)
starts = torch.tensor([2, 0, 100, 1, 64])  # a cascade step's own level: positions from its group's prefix
o, lse = td.decode(q, kc, vc, table, rows, prefix, 1 / math.sqrt(d), splits=5, return_lse=True, starts=starts)
ro, rl = ref(q, 1.0, 1.0, starts)
assert torch.allclose(o, ro, atol=1e-4, rtol=1e-4) and torch.allclose(lse, rl, atol=1e-4, rtol=1e-4)
# into rows of larger tensors (a mixed step's output: the decodes' rows first): the same values, written in place
big, big_lse = torch.full((8, hq, d), 7.0), torch.full((8, hq), 7.0)
o2, lse2 = td.decode(q, kc, vc, table, rows, prefix, 1 / math.sqrt(d), splits=5, return_lse=True, starts=starts,
                     out=big[1:6], lse_out=big_lse[1:6])
assert o2.data_ptr() == big[1].data_ptr() and lse2.data_ptr() == big_lse[1].data_ptr()
assert torch.equal(big[1:6], o) and torch.equal(big_lse[1:6], lse)
assert (big[0] == 7).all() and (big[6:] == 7).all() and (big_lse[6:] == 7).all()  # (nothing else written)
for splits in (1, 4):  # (one split stores its result directly; more merge in the last program)
    one = torch.full((8, hq, d), 7.0)
    td.decode(q, kc, vc, table, rows, prefix, 1 / math.sqrt(d), splits=splits, out=one[3:])
    assert torch.allclose(one[3:], ref(q, 1.0, 1.0)[0], atol=1e-4, rtol=1e-4) and (one[:3] == 7).all()
# a graph's buffers: the slots of each request's positions 0..prefix in one flat list, its offset as its row
flat = torch.cat([table[r, :int(p) + 1] for r, p in zip(rows.tolist(), prefix.tolist(), strict=True)])
offsets = torch.tensor([0] + [int(p) + 1 for p in prefix.tolist()]).cumsum(0)[:-1].to(torch.int32)
o = td.decode(q, kc, vc, flat, offsets, prefix, 1 / math.sqrt(d), 0.5, 2.0, splits=3, table_stride=1)
assert torch.allclose(o, ref(q, 0.5, 2.0)[0], atol=1e-4, rtol=1e-4)
o = td.decode(q, kc, vc, table, rows, prefix, 1 / math.sqrt(d), 0.5, 2.0, splits=3, f16=True)  # products in fp16
assert o.dtype == q.dtype and torch.allclose(o, ref(q, 0.5, 2.0)[0], atol=2e-2, rtol=2e-2)
# an FP8 pool widened to fp16 by integer operations ("int": the CPU's stand-in for "asm") against the conversion
e4 = torch.float8_e4m3fn
bytes_ = torch.randint(0, 256, (2, S, hkv, d), generator=g, dtype=torch.uint8)
bytes_[(bytes_ & 0x7F) == 0x7F] = 0x3C  # (no NaN pattern: the pool's writes clamp to ±448)
bytes_[0, :40] = torch.arange(40 * hkv * d).view(40, hkv, d) % 16  # (subnormals and zeros among them)
k8, v8 = bytes_[0].view(e4), bytes_[1].view(e4)
qs = q * 0.05
want = ref_with(qs, k8.float(), v8.float(), 0.5, 2.0)
for splits in (1, 4):
    got = td.decode(qs, k8, v8, table, rows, prefix, 1 / math.sqrt(d), 0.5, 2.0, splits=splits, f16=True, widen="int")
    cvt = td.decode(qs, k8, v8, table, rows, prefix, 1 / math.sqrt(d), 0.5, 2.0, splits=splits, f16=True, widen="cvt")
    assert torch.allclose(got, cvt, atol=1e-6, rtol=1e-6), (got - cvt).abs().max()  # (the same products, 2^8 apart)
    assert (got - want).abs().max() <= 2e-3 * want.abs().max(), (got - want).abs().max()  # (fp16 probabilities)
# a large GQA group (16 query heads a KV head, D 128): the last program merges 16, 8 or 3 parts, a part a load
hq2, d2 = 32, 128
kc2, vc2 = torch.randn(S, hkv, d2, generator=g), torch.randn(S, hkv, d2, generator=g)
q2 = torch.randn(5, hq2, d2, generator=g)
want2 = []
for b in range(len(rows)):
    sl = table[rows[b], :int(prefix[b]) + 1].long()
    s2 = torch.einsum("hd,nhd->hn", q2[b], kc2[sl].repeat_interleave(hq2 // hkv, 1)) / math.sqrt(d2)
    want2.append(torch.einsum("hn,nhd->hd", s2.softmax(-1), vc2[sl].repeat_interleave(hq2 // hkv, 1)))
for splits in (16, 8, 3):
    o = td.decode(q2, kc2, vc2, table, rows, prefix, 1 / math.sqrt(d2), splits=splits)
    assert torch.allclose(o, torch.stack(want2), atol=1e-4, rtol=1e-4), (splits, (o - torch.stack(want2)).abs().max())
# BANYAN_DECODE_PIPE=1 (the table slots a block ahead, V loaded with K): the same bits, any split or block
import os
from shared import knobs as registry
for splits, block, st in ((1, 64, None), (3, 16, None), (16, 16, starts), (2, 32, starts)):
    got = []
    for pipe in ("0", "1"):
        os.environ["BANYAN_DECODE_PIPE"] = pipe
        registry.reload()
        got.append(td.decode(q, kc, vc, table, rows, prefix, 1 / math.sqrt(d), 0.5, 2.0, splits=splits, block=block,
                             return_lse=True, starts=st))
    assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1]), (splits, block)
    assert torch.allclose(got[1][0], ref(q, 0.5, 2.0, st)[0], atol=1e-4, rtol=1e-4), (splits, block)
    fp8 = []  # (an FP8 pool widened in fp16: the same bits too)
    for pipe in ("0", "1"):
        os.environ["BANYAN_DECODE_PIPE"] = pipe
        registry.reload()
        fp8.append(td.decode(qs, k8, v8, table, rows, prefix, 1 / math.sqrt(d), 0.5, 2.0, splits=splits, block=block,
                             f16=True, widen="int", starts=st))
    assert torch.equal(fp8[0], fp8[1]), (splits, block)
os.environ.pop("BANYAN_DECODE_PIPE")
registry.reload()
for splits, block in ((1, 32), (3, 16)):  # (a graph's flat table, pipelined by the launch's own ``pipe``)
    a, b = (td.decode(q, kc, vc, flat, offsets, prefix, 1 / math.sqrt(d), 0.5, 2.0, splits=splits, block=block,
                      table_stride=1, pipe=pipe) for pipe in (False, True))
    assert torch.equal(a, b) and torch.allclose(b, ref(q, 0.5, 2.0)[0], atol=1e-4, rtol=1e-4), (splits, block)
assert td.widen_mode(torch.device("cpu"), "asm") == "int"  # (no inline assembly off the GPU)
assert td.num_splits(1, 8) == td.MAX_SPLITS and td.num_splits(1024, 8) == 1 and td.num_splits(16, 8) == 4
assert {td.num_splits(b, 8) for b in range(1, 600)} == set(td.SPLIT_COUNTS)  # (the variants warm_up compiles)
warmed = td.warm_up(torch.float32, torch.float32, (hq, hkv, d), torch.device("cpu"))
assert warmed == 3 * (len(td.SPLIT_COUNTS) + 3)  # (each split count's launch, the bands' three)
# one launch: each (request, KV head)'s last program merged its parts, and left its count zero for the next launch
assert int(td._counts[torch.device("cpu")].abs().sum()) == 0
print("triton decode ok")
"""


@pytest.mark.timeout(300)
def test_triton_decode_in_the_interpreter() -> None:
    pytest.importorskip("triton", reason="Triton is not installed")
    run_in_triton_interpreter(SCRIPT, "triton decode ok", timeout=280)


def test_pdl_launches_only_on_cuda_and_not_when_turned_off(monkeypatch) -> None:
    from services.worker.kernels import triton_pdl

    assert not triton_pdl.launch_pdl(torch.device("cpu"))  # (CPU tensors: the interpreter, no launch option)
    try:
        monkeypatch.setenv("BANYAN_TRITON_PDL", "0")  # (turned off: no device queried, off before anything else)
        triton_pdl._supported.cache_clear()
        assert not triton_pdl._supported(0)
        monkeypatch.setenv("BANYAN_TRITON_PDL", "1")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        triton_pdl._supported.cache_clear()
        assert not triton_pdl._supported(0)  # (the interpreter launches nothing)
    finally:
        triton_pdl._supported.cache_clear()


def test_which_decode_plans_auto_sends_to_the_triton_kernel(monkeypatch) -> None:
    from services.worker.attention import triton_decode as td

    assert td.triton_rows_up_to("flashinfer", "cuda", True) == 0
    assert td.triton_rows_up_to("triton", "cuda", False) == td.MAX_PAIRS
    # bf16/fp16 pool: batches up to 255 rows (the decode graphs'), FlashInfer's above
    assert td.triton_rows_up_to("auto", "cuda", False) == td.AUTO_TRITON_ROWS == 255
    monkeypatch.setenv("BANYAN_DECODE_TRITON_ROWS", "16")  # (as before 2026-12-05: the A/B knob)
    registry.reload()
    try:
        assert td.triton_rows_up_to("auto", "cuda", False) == 16
        assert td.triton_rows_up_to("auto", "cuda", True) == td.MAX_PAIRS  # FP8 pool: every decode
        assert td.triton_rows_up_to("auto", "cpu", True) == 0  # (no Triton launches off CUDA)
        with pytest.raises(ValueError, match="bad decode kernel"):
            td.triton_rows_up_to("fa3", "cuda", False)
    finally:
        monkeypatch.delenv("BANYAN_DECODE_TRITON_ROWS")
        registry.reload()


def test_launch_configurations_by_batch(monkeypatch) -> None:
    from services.worker.attention import decode_rules as dr
    from services.worker.attention import triton_decode as td
    from services.worker.attention.decode_rules import Launch as L

    def clear() -> None:
        registry.reload()

    for name in ("BANYAN_DECODE_BLOCK", "BANYAN_DECODE_WARPS", "BANYAN_DECODE_STAGES", "BANYAN_DECODE_PIPE"):
        monkeypatch.delenv(name, raising=False)
    clear()
    try:
        # bf16/fp16 pools: a power of two filling the GPU, 64-token blocks, 4 warps, 2 stages; the pipelined bands
        # (slots a block ahead, 32-token blocks): one split at 4 stages up to one wave of 4 programs an SM (66 rows
        # of 8 KV heads), at 3 stages up to one of 5 (82 rows), two splits at 3 stages up to 96 rows
        b4, b3, b2 = L(1, 32, 4, 4, True), L(1, 32, 4, 3, True), L(2, 32, 4, 3, True)
        rows = (1, 16, 31, 32, 66, 67, 82, 83, 96, 97, 128, 1024)
        assert [td.launch_config(b, 8, False) for b in rows] == [
            L(16, 64, 4, 2, False), L(4, 64, 4, 2, False), L(2, 64, 4, 2, False), b4, b4, b3, b3, b2, b2,
            L(1, 64, 4, 2, False), L(1, 64, 4, 2, False), L(1, 64, 4, 2, False)]
        # FP8 pools: two splits up to 128 rows of 8 KV heads, 128-token blocks on 4 warps, one split above (64 on 2
        # warps from 512 rows); pipelined 64-token blocks on 2 warps: two splits at 32-47 rows, one at 48-66 and
        # at 101-132 (two full waves)
        f2, f1 = L(2, 64, 2, 3, True), L(1, 64, 2, 3, True)
        rows = (1, 16, 31, 32, 47, 48, 66, 67, 100, 101, 128, 132, 133, 511, 512, 4096)
        assert [td.launch_config(b, 8, True) for b in rows] == [
            L(16, 64, 4, 3, False), L(4, 64, 4, 3, False), L(2, 128, 4, 3, False), f2, f2, f1, f1,
            L(2, 128, 4, 3, False), L(2, 128, 4, 3, False), f1, f1, f1, L(1, 128, 4, 3, False),
            L(1, 128, 4, 3, False), L(1, 64, 2, 3, False), L(1, 64, 2, 3, False)]
        assert td.launch_config(1024, 8, True, splits=4) == L(4, 64, 4, 3, False)  # (a forced count keeps its own)
        assert td.launch_config(64, 8, False, splits=2) == L(2, 64, 4, 2, False)  # (and leaves the bands)
        every = {td.launch_config(b, 8, fp8) for b in range(1, 8193) for fp8 in (False, True)}
        assert {c for c in every if c.pipe} == {b4, b3, b2, f2, f1}
        # BANYAN_DECODE_PIPE=0: the launches before the band; =1: every launch pipelined, at least 3 stages
        monkeypatch.setenv("BANYAN_DECODE_PIPE", "0")
        clear()
        assert td.launch_config(64, 8, False) == L(2, 64, 4, 2, False)
        assert td.launch_config(64, 8, True) == L(2, 128, 4, 3, False)
        monkeypatch.setenv("BANYAN_DECODE_PIPE", "1")
        clear()
        assert td.launch_config(1, 8, False) == L(16, 64, 4, 3, True) and td.launch_config(64, 8, False) == b4
        monkeypatch.setenv("BANYAN_DECODE_BLOCK", "16")
        monkeypatch.setenv("BANYAN_DECODE_STAGES", "5")
        clear()
        assert td.launch_config(64, 8, True) == L(1, 16, 2, 5, True)  # (the knobs override each field)
        monkeypatch.setenv("BANYAN_DECODE_PIPE", "2")
        clear()
        with pytest.raises(ValueError, match="BANYAN_DECODE_PIPE"):
            td.launch_config(64, 8, True)
    finally:
        for name in ("BANYAN_DECODE_BLOCK", "BANYAN_DECODE_STAGES", "BANYAN_DECODE_PIPE"):
            monkeypatch.delenv(name, raising=False)
        clear()


def td_max_pairs() -> int:
    from services.worker.attention import triton_decode

    return triton_decode.MAX_PAIRS


ROPE_SCRIPT = r"""
import torch
from services.worker.attention import triton_decode as td
from services.worker.kernels.rope_store import reference

from services.worker.attention.decode_rope import check_rope
assert check_rope(torch.device("cpu"), torch.float32)
g = torch.Generator().manual_seed(1)
b, hq, hkv, d, width = 4, 8, 2, 64, 150
table = torch.randperm(b * width, generator=g).view(b, width).to(torch.int32)
rows, pos = torch.tensor([3, 1, 0, 2]), torch.tensor([140, 0, 63, 64])  # (a first token; a split's edge)
slots = table[rows, pos].to(torch.int64)
cos_sin = torch.randn(width, d, generator=g)
qkv = torch.randn(b, (hq + 2 * hkv) * d, generator=g)
caches = [torch.randn(b * width, hkv, d, generator=g) for _ in range(2)]
inv = torch.tensor([0.5, 2.0])
import itertools, os
from shared import knobs as registry
for pipe, splits in itertools.product(("0", "1"), (1, 3, 16)):  # (and with BANYAN_DECODE_PIPE=1)
    os.environ["BANYAN_DECODE_PIPE"] = pipe
    registry.reload()
    for scaled in (None, inv):
        outs = []
        for fused in (True, False):
            x, kv = qkv.clone(), [c.clone() for c in caches]
            q, k, v = (x[:, : hq * d].view(b, hq, d), x[:, hq * d: (hq + hkv) * d].view(b, hkv, d),
                       x[:, (hq + hkv) * d:].view(b, hkv, d))
            if fused:
                o = td.decode(q, *kv, table, rows, pos, d ** -0.5, splits=splits,
                              new=(k, v, cos_sin, pos, slots, scaled, scaled))
                assert torch.equal(x, qkv)  # (q and k left as they were: rotated in registers only)
            else:
                reference(q, k, v, *kv, slots, cos_sin, pos)
                if scaled is not None:  # (float32 caches: scaled and saturated as an FP8 pool's write, not cast)
                    for c in kv:
                        c[slots] = (c[slots] * scaled[:, None]).clamp(-448, 448)
                o = td.decode(q, *kv, table, rows, pos, d ** -0.5, splits=splits)
            outs.append((o, *kv))
        (o, kc, vc), (ro, rkc, rvc) = outs
        assert torch.allclose(o, ro, atol=1e-4, rtol=1e-4), (splits, (o - ro).abs().max())
        assert torch.allclose(kc, rkc, atol=1e-5) and torch.allclose(vc, rvc, atol=1e-5)
        untouched = torch.ones(b * width, dtype=torch.bool)
        untouched[slots] = False
        assert torch.equal(kc[untouched], caches[0][untouched]) and not torch.equal(kc[slots], caches[0][slots])
os.environ.pop("BANYAN_DECODE_PIPE")
registry.reload()
# the comparison tells a wrong rotation apart: the positions one off
x, kv = qkv.clone(), [c.clone() for c in caches]
q, k, v = (x[:, : hq * d].view(b, hq, d), x[:, hq * d: (hq + hkv) * d].view(b, hkv, d),
           x[:, (hq + hkv) * d:].view(b, hkv, d))
o = td.decode(q, *kv, table, rows, pos, d ** -0.5, new=(k, v, cos_sin, pos + 1, slots, None, None))
assert not torch.allclose(o, ro, atol=1e-2)
td.set_rope(True)
warmed = td.warm_up(torch.float32, torch.float32, (hq, hkv, d), torch.device("cpu"))
assert warmed == 4 * (len(td.SPLIT_COUNTS) + 3)  # (each split count's launch, the bands' three)
print("rope in decode ok")
"""


@pytest.mark.timeout(300)
def test_rope_and_the_kv_write_inside_the_decode_in_the_interpreter() -> None:
    pytest.importorskip("triton", reason="Triton is not installed")
    run_in_triton_interpreter(ROPE_SCRIPT, "rope in decode ok", timeout=280)


BACKEND_SCRIPT = r"""
import os
import sys
import torch
from tests import fake_flashinfer
sys.modules["flashinfer"] = fake_flashinfer.module()
from services.worker.attention import triton_decode as td
from services.worker.attention.flashinfer_backend import FlashInferAttention
from services.worker.attention.torch_backend import TorchAttention
from services.worker.kernels.ops import TORCH_OPS
from tests.cascade_cases import build

td.set_rope(True)
calls, decode = [], td.decode
td.decode = lambda *a, **kw: (calls.append(kw.get("new") is not None), decode(*a, **kw))[1]
hq, hkv, d = 8, 2, 64
cos_sin = torch.randn(1024, d, generator=torch.Generator().manual_seed(9))
for name in ("decode", "mixed"):
    pool, plain, _, (q, k, v) = build(name, hq, hkv, d, torch.float32, "cpu")
    rope = TORCH_OPS.rope(cos_sin, plain.positions, torch.float32)
    fi = FlashInferAttention(pool, hq, decode_kernel="triton")
    fi.prepare(plain)
    assert fi._rope_in_decode == (name == "decode")  # (pure decodes only: a mixed step's chunks need the rope)
    calls.clear()
    got = fi.forward(q.clone(), k.clone(), v, 0, rope=rope)
    assert calls == [name == "decode"]  # (mixed: its decode rows through the kernel, the rope done before it)
    ref_pool = build(name, hq, hkv, d, torch.float32, "cpu")[0]
    ref = TorchAttention(ref_pool)
    ref.prepare(plain)
    want = ref.forward(q.clone(), k.clone(), v, 0, rope=rope)
    assert torch.allclose(got, want, atol=2e-4, rtol=2e-4), (name, (got - want).abs().max())
    assert torch.allclose(pool.k[0], ref_pool.k[0], atol=1e-5) and torch.equal(pool.v[0], ref_pool.v[0])
    fi = FlashInferAttention(pool, hq, decode_kernel="flashinfer")
    fi.prepare(plain)
    assert not fi._rope_in_decode
# a decode graph's launch: the batch's table rows (out of order here) gathered into the graph's fixed table
import dataclasses
pool, plain, _, (q, k, v) = build("decode", hq, hkv, d, torch.float32, "cpu")
n, width = plain.num_reqs, plain.req_to_token.shape[1]
perm = torch.randperm(n + 2, generator=torch.Generator().manual_seed(3))[:n]
table = torch.zeros(n + 3, width + 16, dtype=torch.int32)
table[perm, :width] = plain.req_to_token[:n]
rope = TORCH_OPS.rope(cos_sin, plain.positions, torch.float32)
fi = FlashInferAttention(pool, hq, decode_kernel="triton")
fi.init_graph([n], width)
fi.prepare_graph(dataclasses.replace(plain, req_to_token=table, rows=perm), n)
assert fi._rope_in_decode
got = fi.forward(q.clone(), k.clone(), v, 0, rope=rope)
ref_pool = build("decode", hq, hkv, d, torch.float32, "cpu")[0]
ref = TorchAttention(ref_pool)
ref.prepare(plain)
want = ref.forward(q.clone(), k.clone(), v, 0, rope=rope)
assert torch.allclose(got, want, atol=2e-4, rtol=2e-4), (got - want).abs().max()
assert torch.allclose(pool.k[0], ref_pool.k[0], atol=1e-5) and torch.equal(pool.v[0], ref_pool.v[0])
print("backend rope ok")
"""


@pytest.mark.timeout(300)
def test_the_backend_hands_a_decode_step_rope_to_the_triton_kernel_in_the_interpreter() -> None:
    pytest.importorskip("triton", reason="Triton is not installed")
    run_in_triton_interpreter(BACKEND_SCRIPT, "backend rope ok", timeout=280)


def test_the_decode_knobs_are_read_once_and_checked(monkeypatch) -> None:
    from services.worker.attention import decode_rules as dr

    for name in ("BANYAN_DECODE_BLOCK", "BANYAN_DECODE_WARPS", "BANYAN_DECODE_MIN_PART", "BANYAN_DECODE_WARM"):
        monkeypatch.delenv(name, raising=False)
    try:
        registry.reload()
        assert dr.knobs() == (None, None, dr.MIN_PART, True)  # (block and warps: the launch rule's)
        monkeypatch.setenv("BANYAN_DECODE_WARM", "0")
        assert dr.knobs()[3] is True  # (read once a process: unchanged until cleared)
        registry.reload()
        assert dr.knobs()[3] is False
        monkeypatch.setenv("BANYAN_DECODE_BLOCK", "48")
        registry.reload()
        with pytest.raises(registry.KnobError, match="BANYAN_DECODE_BLOCK"):
            dr.knobs()
        monkeypatch.delenv("BANYAN_DECODE_BLOCK")
        monkeypatch.delenv("BANYAN_DECODE_STAGES", raising=False)
        registry.reload()
        assert dr.plain_stages() is None
        monkeypatch.setenv("BANYAN_DECODE_STAGES", "3")
        assert dr.plain_stages() is None  # (read once)
        registry.reload()
        assert dr.plain_stages() == 3
        monkeypatch.setenv("BANYAN_DECODE_STAGES", "9")
        registry.reload()
        with pytest.raises(registry.KnobError, match="BANYAN_DECODE_STAGES"):
            dr.plain_stages()
    finally:
        monkeypatch.undo()
        registry.reload()
