"""The start-up check of the rope and the new token's K/V write done inside the Triton decode (``triton_decode``
with ``new``): it is turned on only where it agrees, on the device, with the two steps it replaces."""

from __future__ import annotations

import torch

from shared import knobs
from services.worker.attention.triton_decode import decode, set_rope


def enable_rope(device: torch.device, dtype: torch.dtype) -> str:
    """The Triton decode rotating q and k and writing the new token's K/V itself (no rope + write kernel before it in
    pure-decode steps) where ``check_rope`` finds it agreeing with the two steps on ``device`` → what the decode
    steps use (logged). The ``rope_in_decode`` knob off turns it off (W1 FP8 on the H200: 2.80 → 2.77 ms with it)."""
    set_rope(False)
    if not knobs.get("rope_in_decode"):
        return "off"
    try:
        if check_rope(device, dtype):
            set_rope(True)
            return "in the triton decode"
        return "off (the fused decode disagreed with the rope, then the write)"
    except Exception as e:  # no Triton, a compiler problem: the separate steps are correct
        return f"off ({type(e).__name__}: {e})"[:300]


def check_rope(device: torch.device, q_dtype: torch.dtype) -> bool:
    """``decode`` with ``new`` against ``rope_store.reference`` then ``decode`` on ``device``, on a pool of
    ``q_dtype`` and an FP8 one (CUDA): the outputs within 2 % and the written K/V as the reference writes them
    (one rounding; an e4m3 step when FP8), the pool elsewhere untouched."""
    from services.worker.kernels.rope_store import reference
    from services.worker.quant.fp8 import FP8

    g = torch.Generator(device="cpu").manual_seed(5)
    b, hq, hkv, d, width = 3, 8, 2, 128, 96
    table = torch.randperm(b * width, generator=g).view(b, width).to(torch.int32).to(device)
    rows = torch.tensor([2, 0, 1], device=device)
    pos = torch.tensor([70, 5, 95], device=device)
    slots = table[rows, pos].to(torch.int64)
    cos_sin = torch.randn(width, d, generator=g).to(device)
    for pool_dtype in (q_dtype, FP8) if device.type == "cuda" else (q_dtype,):
        qkv = torch.randn(b, (hq + 2 * hkv) * d, generator=g).to(q_dtype).to(device)
        caches = [(torch.randn(b * width, hkv, d, generator=g) * 2).to(pool_dtype).to(device) for _ in range(2)]
        fp8 = pool_dtype == FP8
        inv = torch.full((hkv,), 0.7, device=device) if fp8 else None
        scales = dict(k_scale=1 / 0.7, v_scale=1 / 0.7, f16=True) if fp8 else {}
        runs = []
        for fused in (True, False):
            x, kv = qkv.clone(), [c.clone() for c in caches]
            q, k, v = x[:, : hq * d].view(b, hq, d), x[:, hq * d: (hq + hkv) * d].view(b, hkv, d), x[:, (hq + hkv) * d:]
            v = v.view(b, hkv, d)
            if fused:
                o = decode(q, *kv, table, rows, pos, d ** -0.5, new=(k, v, cos_sin, pos, slots, inv, inv), **scales)
            else:
                reference(q, k, v, *kv, slots, cos_sin, pos, inv, inv)
                o = decode(q, *kv, table, rows, pos, d ** -0.5, **scales)
            runs.append((o.float(), *(c.float() for c in kv)))
        (o, kc, vc), (ro, rkc, rvc) = runs
        if not torch.allclose(o, ro, rtol=2e-2, atol=2e-2):
            return False
        for got, want in ((kc, rkc), (vc, rvc)):
            tol = want.abs() * 0.13 + 2**-9 if fp8 else want.abs() * 2**-6 + 1e-6
            if not bool(((got - want).abs() <= tol).all()):
                return False
    return True
