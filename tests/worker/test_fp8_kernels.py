"""The FP8 Triton kernels (per-token activation quantization, the add-RMSNorm and SiLU-and-multiply that
quantize as they write, the quantized KV write — and the same write unscaled, a bf16 pool's) in Triton's
interpreter on the CPU, against the PyTorch reference math: indexing, strides, per-head scales,
saturation, all-zero rows. They write float32 here (the interpreter's emulated fp8 cast does not
round as the GPU does); the e4m3 cast itself is checked on the GPU at start-up (``check_*``) and by
the GPU tests. Skipped visibly where Triton is not installed."""

from __future__ import annotations


import pytest

from tests.support import run_in_triton_interpreter

SCRIPT = r"""
import torch
from services.worker.quant import triton_kernels as tk

g = torch.Generator().manual_seed(0)
x = torch.randn(6, 300, generator=g) * torch.logspace(-2, 3, 6)[:, None]
x[2] = 0
x[4, 7] = 1e6  # one outlier: its row's scale follows it
q, s = tk.per_token_quant(x[:, :280], out_dtype=torch.float32)  # a strided view (rows of 300)
s_ref = (x[:, :280].abs().amax(1, keepdim=True) / 448).clamp(min=1e-12)
assert torch.allclose(s, s_ref, rtol=1e-6, atol=0), (s, s_ref)
assert torch.allclose(q, (x[:, :280] / s_ref).clamp(-448, 448), rtol=1e-5, atol=1e-6)
assert (q[2] == 0).all() and q[4, 7] == 448

t, hkv, d = 5, 3, 24  # head_dim not a power of two
qkv = torch.randn(t, (4 + 2 * hkv) * d, generator=g) * 300
k = qkv[:, 4 * d:(4 + hkv) * d].unflatten(-1, (hkv, d))
v = qkv[:, (4 + hkv) * d:].unflatten(-1, (hkv, d))
slots = torch.tensor([7, 2, 11, 0, 5])
k_inv, v_inv = torch.tensor([1.0, 0.5, 4.0]), torch.tensor([2.0, 1.0, 0.25])
kc, vc = torch.full((12, hkv, d), -1.0), torch.full((12, hkv, d), -1.0)
tk.store_kv(kc, vc, slots, k, v, k_inv, v_inv)
assert torch.equal(kc[slots], (k * k_inv[:, None]).clamp(-448, 448))
assert torch.equal(vc[slots], (v * v_inv[:, None]).clamp(-448, 448))
rest = torch.ones(12, dtype=torch.bool)
rest[slots] = False
assert (kc[rest] == -1).all() and (vc[rest] == -1).all()
assert (kc[slots].abs().amax() == 448) and (vc[slots].abs().amax() == 448)  # saturated somewhere
kc, vc = torch.full((12, hkv, d), -1.0), torch.full((12, hkv, d), -1.0)
tk.store_kv(kc, vc, slots, k, v)  # no scales: a plain pool's write, K and V copied as they are
assert torch.equal(kc[slots], k) and torch.equal(vc[slots], v) and (kc[rest] == -1).all() and (vc[rest] == -1).all()
# the add-RMSNorm and SiLU-and-multiply that quantize as they write (rows of 300 read as 280: strided)
xs, rs = torch.randn(5, 300, generator=g) * 3, torch.randn(5, 300, generator=g)
xs[1], rs[1] = 0, 0  # an all-zero row: zeros, the scale floor
w = 1 + torch.randn(280, generator=g) / 4
for res in (rs[:, :280], None):
    qa, r_out = tk.add_rmsnorm_quant(xs[:, :280], res, w, 1e-6, out_dtype=torch.float32)
    h = xs[:, :280] + (res if res is not None else 0)
    assert torch.equal(r_out, h) if res is not None else r_out is xs[:, :280] or torch.equal(r_out, xs[:, :280])
    y = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    s_ref = (y.abs().amax(1, keepdim=True) / 448).clamp(min=1e-12)
    assert torch.allclose(qa.scale, s_ref, rtol=1e-5, atol=0), (qa.scale, s_ref)
    assert torch.allclose(qa.q, (y / s_ref).clamp(-448, 448), rtol=1e-4, atol=1e-4)
    assert (qa.q[1] == 0).all() and qa.q.abs().amax() == 448 and qa.dtype == torch.float32
hs = torch.randn(4, 2 * 5000 + 6, generator=g) * 3  # gate | up of 5,000 (two 4,096-wide blocks), strided rows
qa = tk.silu_mul_quant(hs[:, :10000], out_dtype=torch.float32)
gate, up = hs[:, :5000], hs[:, 5000:10000]
a = torch.nn.functional.silu(gate) * up
s_ref = a.abs().amax(1, keepdim=True) / 448
assert torch.allclose(qa.scale, s_ref, rtol=1e-5, atol=0) and qa.q.shape == (4, 5000)
assert torch.allclose(qa.q, a / s_ref, rtol=1e-4, atol=1e-4)
print("kernels ok")
"""


@pytest.mark.timeout(300)
def test_triton_kernels_in_the_interpreter() -> None:
    pytest.importorskip("triton", reason="Triton is not installed")
    run_in_triton_interpreter(SCRIPT, "kernels ok", timeout=280)
