"""The fused rope + K/V write (``kernels/rope_store.py``) in Triton's interpreter on the CPU against
its PyTorch reference and against the two steps it replaces (the layers' rope, then the pool's
write): strided q/k/v views of one qkv tensor, positions out of order, GQA heads, scaled and
saturated writes, both launch shapes (a head a program; token blocks) (float32 caches here: the interpreter's emulated fp8 cast does not round as the
GPU does; ``check`` runs the bf16/fp16/e4m3 cases on the device at start-up). Skipped visibly where
Triton is not installed."""

from __future__ import annotations

import pytest

from tests.support import run_in_triton_interpreter

SCRIPT = r"""
import torch
from services.worker.kernels import rope_store as rs
from services.worker.kernels.ops import TORCH_OPS, apply_rotary

g = torch.Generator().manual_seed(0)
t, hq, hkv, d = 5, 8, 2, 64
freqs = torch.arange(50, dtype=torch.float32)[:, None] * (1.0 / 10000 ** (torch.arange(0, d, 2) / d))[None, :]
cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1)  # (P, D) as RotaryEmbedding builds it
positions = torch.tensor([17, 3, 49, 0, 3])
slots = torch.tensor([7, 2, 11, 0, 5])
qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g) * 30

def views(x):
    return (x[:, : hq * d].unflatten(-1, (hq, d)), x[:, hq * d: (hq + hkv) * d].unflatten(-1, (hkv, d)),
            x[:, (hq + hkv) * d:].unflatten(-1, (hkv, d)))

for rows_from, inv in ((64, None), (64, (torch.tensor([1.0, 0.05]), torch.tensor([0.5, 20.0]))), (1, None),
                      (1, (torch.tensor([1.0, 0.05]), torch.tensor([0.5, 20.0])))):
    rs.ROWS_FROM = rows_from  # 64: a head a program (decode sizes); 1: token blocks (prefill), the last partial
    got, want = qkv.clone(), qkv.clone()
    caches = [torch.full((12, hkv, d), -1.0) for _ in range(4)]
    rs.rope_store(*views(got), caches[0], caches[1], slots, cos_sin, positions, *(inv or (None, None)))
    q, k, v = views(want)
    cos, sin = cos_sin[positions, : d // 2], cos_sin[positions, d // 2:]
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)  # the layers' rope (float32 here)
    assert torch.allclose(views(got)[0], q, rtol=1e-5, atol=1e-4) and torch.allclose(views(got)[1], k, rtol=1e-5, atol=1e-4)
    assert torch.equal(views(got)[2], v)  # v as it was
    k_want, v_want = (k, v) if inv is None else ((k * inv[0][:, None]).clamp(-448, 448), (v * inv[1][:, None]).clamp(-448, 448))
    assert torch.allclose(caches[0][slots], k_want, rtol=1e-5, atol=1e-4) and torch.allclose(caches[1][slots], v_want)
    rest = torch.ones(12, dtype=torch.bool)
    rest[slots] = False
    assert (caches[0][rest] == -1).all() and (caches[1][rest] == -1).all()
    if inv is not None:
        assert caches[0][slots].abs().max() < 448 and caches[1][slots].abs().max() == 448  # V saturated
    else:  # the reference: the same contract, in PyTorch
        ref = qkv.clone()
        rs.reference(*views(ref), caches[2], caches[3], slots, cos_sin, positions)
        assert torch.allclose(ref, got, rtol=1e-5, atol=1e-4) and torch.allclose(caches[2], caches[0], rtol=1e-5, atol=1e-4)

rs.ROWS_FROM = 64
# the pool's entry point: the same rotated q, k and pool with the kernel set as without it
from services.worker.kv_pool import KVPool
from services.worker.quant import kv
rope = TORCH_OPS.rope(cos_sin, positions, torch.float32)
outs = []
for fn in (None, rs.rope_store):
    kv.set_rope_store_kernel(fn)
    pool = KVPool(2, 12, hkv, d, torch.float32, "cpu")
    x = qkv.clone()
    q, k = pool.store_rope(1, slots, *views(x), rope)
    outs.append((q, k, pool.buf))
kv.set_rope_store_kernel(None)
assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-4) for a, b in zip(*outs))
assert outs[1][2][:, 0].abs().sum() == 0 and outs[1][2][:, 1].abs().sum() > 0  # layer 1 only
print("rope-store ok")
"""


@pytest.mark.timeout(300)
def test_rope_store_kernel_in_the_interpreter() -> None:
    pytest.importorskip("triton", reason="Triton is not installed")
    run_in_triton_interpreter(SCRIPT, "rope-store ok", timeout=280)
