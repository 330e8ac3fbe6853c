"""The decode-size linear kernel (``kernels/small_m.py``) in Triton's interpreter on the CPU: bf16-
shaped and e4m3 weights with per-row scales, every config (tensor-core, swapped, CUDA-core; K split or not), M from 1 to 16 (each row's result independent of M for a config, bit for bit), N and K not
multiples of the blocks, a strided activation, the CUDA-core loop with its next tile prefetched; and the dispatch: a layer takes the kernel only for a
weight shape and M range ``kernels.choices`` holds. Float32 activations here
(the interpreter has no bf16 matmul); the GPU path is timed and checked at start-up (``tune``).
Skipped visibly where Triton is not installed."""

from __future__ import annotations

import pytest
import torch

from services.worker import kernels
from tests.support import run_in_triton_interpreter

SCRIPT = r"""
import torch
from services.worker.kernels import small_m as sm
from services.worker.quant.fp8 import quantize_rows

g = torch.Generator().manual_seed(0)
for n, k in ((40, 300), (64, 1024)):
    w = torch.randn(n, k, generator=g)
    q, s = quantize_rows(w)
    for m in (1, 3, 16):
        x = torch.randn(m, k + 8, generator=g)[:, :k]  # a strided view
        want_plain = x @ w.t()
        want_q = (x @ q.float().t()) * s
        for cfg in sm.CONFIGS:
            got = sm.linear(x, w, None, cfg)
            assert torch.equal(sm.linear(x[:1], w, None, cfg), got[:1])  # row 0 alone: the same bits
            h = torch.randn(m, 2 * k, generator=g)  # [gate | up]: the activation fused into the read
            fused = sm.linear(h, w, None, cfg, silu_mul=True)
            want_f = (torch.nn.functional.silu(h[:, :k]) * h[:, k:]) @ w.t()
            assert torch.allclose(fused, want_f, rtol=1e-4, atol=1e-3), (n, k, m, cfg, (fused - want_f).abs().max())
            assert got.shape == (m, n) and got.dtype == torch.float32
            assert torch.allclose(got, want_plain, rtol=1e-4, atol=1e-3), (n, k, m, cfg, (got - want_plain).abs().max())
            got = sm.linear(x, q, s, cfg)
            assert torch.allclose(got, want_q, rtol=1e-4, atol=1e-3), (n, k, m, cfg, (got - want_q).abs().max())
            if cfg.last_adds:  # the parts added by the tile's last program: what the second kernel adds
                two = sm.Config(**{**cfg.__dict__, "last_adds": False})
                assert torch.equal(got, sm.linear(x, q, s, two)), (n, k, m, cfg)
                assert torch.equal(sm.linear(h, w, None, cfg, silu_mul=True), sm.linear(h, w, None, two, silu_mul=True))
                assert not sm._counts[x.device].any()  # every count back to zero for the next call
print("small-m ok")
"""


@pytest.mark.timeout(600)
def test_small_m_kernel_in_the_interpreter() -> None:
    pytest.importorskip("triton", reason="Triton is not installed")
    run_in_triton_interpreter(SCRIPT, "small-m ok", timeout=580)


def test_a_layer_takes_the_kernel_only_for_a_chosen_shape(monkeypatch) -> None:
    from services.worker.models.layers import ColumnParallelLinear
    from services.worker.tp import TPGroup

    calls = []
    monkeypatch.setattr(kernels, "small_m_linear", lambda x, w, s, cfg, silu_mul=False, act_out=False: calls.append(cfg) or x @ w.t())
    monkeypatch.setattr(kernels, "choices", {})
    lin = ColumnParallelLinear(32, 48, bias=False, tp=TPGroup())
    torch.manual_seed(0)
    lin.weight.data.normal_()
    x = torch.randn(4, 32)
    want = x @ lin.weight.t()
    assert torch.allclose(lin(x), want) and calls == []  # nothing chosen: the library
    kernels.choices[(48, 32, lin.weight.dtype)] = ((1, "one"), (4, None), (kernels.MAX_M, "many"))
    assert torch.allclose(lin(x), want) and calls == []  # M = 4: that range's choice is the library
    assert torch.allclose(lin(x[:1]), x[:1] @ lin.weight.t()) and calls == ["one"]  # M = 1: its range's config
    five = torch.randn(5, 32)
    assert torch.allclose(lin(five), five @ lin.weight.t()) and calls == ["one", "many"]
    big = torch.randn(kernels.MAX_M + 1, 32)
    assert torch.allclose(lin(big), big @ lin.weight.t()) and calls == ["one", "many"]  # more rows: the library
    kernels.choices.clear()
    kernels.choices[(48, 33, lin.weight.dtype)] = ((kernels.MAX_M, "other"),)
    assert torch.allclose(lin(x), want) and calls == ["one", "many"]  # another shape chosen: not this one


def test_tune_decides_once_per_shape_and_only_for_a_correct_faster_kernel(monkeypatch) -> None:
    pytest.importorskip("triton", reason="Triton is not installed")
    from services.worker.kernels import small_m as sm

    kernels.reset()
    state = {"k": 5e-6, "lib": 10e-6, "ok": True, "last": ""}

    def kernel(x, w, s, cfg, silu_mul=False, act_out=False):
        state["last"] = "k"
        return x @ w.t() if state["ok"] else x @ w.t() + 1

    def library(x, w, s):
        state["last"] = "lib"
        return x @ w.t()

    def timed(fn_for, copies):
        fn_for(0)
        return state[state["last"]]

    monkeypatch.setattr(sm, "_time", timed)
    monkeypatch.setattr(sm, "linear", kernel)
    w = torch.randn(48, 32)
    try:
        report = sm.tune([(w, None), (w, None)], library, torch.float32)
        assert list(report) == ["48x32 float32"] and "library" in report["48x32 float32"]
        want = tuple((top, sm.CONFIGS[0]) for top in kernels.BUCKETS)
        assert kernels.choices[(48, 32, torch.float32)] == want
        state.update(k=50e-6, ok=False)  # slower and wrong now: the decision made stands (once per process)
        assert sm.tune([(w, None)], library, torch.float32) == report
        assert kernels.choices[(48, 32, torch.float32)] == want
        kernels.reset()  # decided again: wrong, so the library
        assert sm.tune([(w, None)], library, torch.float32)["48x32 float32"].count("library") == len(kernels.BUCKETS)
        assert not kernels.choices
        kernels.reset()
        state.update(k=9.9e-6, ok=True)  # correct but < 3 % faster: the library
        assert "dot" not in sm.tune([(w, None)], library, torch.float32)["48x32 float32"]
        assert not kernels.choices
    finally:
        kernels.reset()


def test_a_down_projection_fuses_the_activation_only_where_chosen(monkeypatch) -> None:
    from services.worker.models.layers import RowParallelLinear, SiluAndMul
    from services.worker.tp import TPGroup

    calls = []

    def fake(x, w, s, cfg, silu_mul=False, act_out=False):
        calls.append((cfg, silu_mul))
        if silu_mul:
            gate, up = x.chunk(2, dim=-1)
            x = torch.nn.functional.silu(gate) * up
        return x @ w.t()

    monkeypatch.setattr(kernels, "small_m_linear", fake)
    monkeypatch.setattr(kernels, "choices", {})
    down, act = RowParallelLinear(32, 24, bias=False, tp=TPGroup()), SiluAndMul()
    torch.manual_seed(0)
    down.weight.data.normal_()
    h = torch.randn(3, 64)
    want = down(act(h))
    assert torch.allclose(down.forward_silu_mul(h, act), want) and calls == []  # nothing chosen
    kernels.choices[(24, 32, down.weight.dtype)] = ((kernels.MAX_M, "plain"),)  # the plain read only
    assert torch.allclose(down.forward_silu_mul(h, act), want) and calls == [("plain", False)]
    kernels.choices[(24, 32, down.weight.dtype, "silu_mul")] = ((kernels.MAX_M, "fused"),)
    assert torch.allclose(down.forward_silu_mul(h, act), want) and calls[-1] == ("fused", True)
    big = torch.randn(kernels.MAX_M + 1, 64)
    n = len(calls)
    assert torch.allclose(down.forward_silu_mul(big, act), down(act(big))) and len(calls) == n  # the library


def test_tune_times_the_gate_up_kernel_with_its_activation_made_as_it_stores(monkeypatch) -> None:
    """``act_out``: a [gate | up] weight is timed as projection + SiluAndMul (the library) against the kernel
    that makes the activation itself; its decision is recorded under its own key, checked against silu(gate) · up."""
    pytest.importorskip("triton", reason="Triton is not installed")
    import torch.nn.functional as F

    from services.worker.kernels import small_m as sm
    from services.worker.kernels.ops import _torch_silu_and_mul

    kernels.reset()
    seen = []

    def kernel(x, w, s, cfg, silu_mul=False, act_out=False):
        seen.append(act_out)
        y = x @ w.t()
        return _torch_silu_and_mul(y) if act_out else y

    monkeypatch.setattr(sm, "_time", lambda fn_for, copies: (fn_for(0), 5e-6 if seen and seen[-1] else 10e-6)[1])
    monkeypatch.setattr(sm, "linear", kernel)
    w = torch.randn(48, 32)
    try:
        report = sm.tune([(w, None)], lambda x, w, s: x @ w.t(), torch.float32, act_out=_torch_silu_and_mul)
        assert list(report) == ["48x32 float32 then silu_mul"] and all(seen)
        assert (48, 32, torch.float32, "act_out") in kernels.choices and (48, 32, torch.float32) not in kernels.choices
        x = torch.randn(1, 32)
        assert kernels.small_m_config(x, w, act_out=True) is not None and kernels.small_m_config(x, w) is None
        full = x @ w.t()
        assert torch.allclose(kernel(x, w, None, None, act_out=True), F.silu(full[:, :24]) * full[:, 24:])
    finally:
        kernels.reset()


def test_the_tuners_pick_the_fastest_correct_config_only_when_3_percent_faster() -> None:
    pytest.importorskip("triton", reason="Triton is not installed")
    from services.worker.kernels.small_m import fastest, verdict

    times = {"a": 0.95, "b": 0.90, "wrong": 0.5, "rejected": 0.1, "c": 0.98}

    def timed(cfg):
        if cfg == "rejected":
            raise RuntimeError("out of shared memory")
        return times[cfg]

    assert fastest(list(times), 1.0, lambda c: c != "wrong", timed) == ("b", 0.90)
    assert fastest(["c"], 1.0, lambda c: True, timed) == (None, 1.0 / 1.03)  # (2 % faster: not enough)
    assert fastest(["a", "c"], 1.0, lambda c: True, timed) == ("a", 0.95)  # (5 %: enough)
    assert verdict(64, None, 1.0, 2e-6) == "M≤64: library 2.0 us"
    assert verdict(64, "b", 1e-6, 2e-6) == "M≤64: b 1.0 us vs library 2.0"
