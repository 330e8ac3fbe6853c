"""The CUDA decode-size linear's CPU-checkable parts (``kernels/cuda_gemv.py``, ``gemv.cu``): the
integer widening of e4m3 weights is exact for every code in both activation types; the source compiles
with nvcc for Hopper into a library exporting the launcher (and is then found in the cache, not built
again); without a CUDA tensor no config is offered, so the tuner keeps the Triton and library paths.
The products themselves run in ``tests/gpu/test_cuda_gemv_gpu.py``."""

from __future__ import annotations

import ctypes
import time

import pytest
import torch

from services.worker.kernels import cuda_gemv

FP8 = torch.float8_e4m3fn


@pytest.mark.parametrize(("bf16", "dtype", "power"), [(True, torch.bfloat16, 2.0**120), (False, torch.float16, 2.0**8)])
def test_the_integer_widening_is_exact_for_every_code(bf16, dtype, power) -> None:
    codes = torch.arange(256, dtype=torch.uint8)
    true = codes.view(FP8).double()
    pattern = cuda_gemv.widen_reference(codes, bf16)
    assert int(pattern.min()) >= 0 and int(pattern.max()) <= 0xFFFF
    value = pattern.to(torch.int32).to(torch.int16).view(dtype).double() * power  # (16-bit patterns, wrapped)
    finite = ~torch.isnan(true)
    assert int(finite.sum()) == 254  # (0x7F and 0xFF are e4m3fn's NaNs)
    assert torch.equal(value[finite], true[finite])
    assert torch.equal(value[0x01:0x08], true[0x01:0x08]) and float(value[0x01]) == 2.0**-9  # subnormals too


def test_the_source_compiles_for_hopper_and_is_cached(tmp_path) -> None:
    nvcc = cuda_gemv.find_nvcc()
    if nvcc is None:
        pytest.skip("nvcc not installed here (the GPU host has it)")
    lib = cuda_gemv.build("sm_90a", nvcc, tmp_path)
    assert lib.is_file() and lib.parent == tmp_path and "sm_90a_bf16" in lib.name
    assert hasattr(ctypes.CDLL(str(lib)), "banyan_gemv") and hasattr(ctypes.CDLL(str(lib)), "banyan_add_rmsnorm")
    t0 = time.monotonic()
    assert cuda_gemv.build("sm_90a", nvcc, tmp_path) == lib  # (the cache: same source, arch, type and nvcc)
    assert time.monotonic() - t0 < 5
    assert [p.name for p in tmp_path.iterdir()] == [lib.name]  # (no temporary left behind)
    fp16 = cuda_gemv.build("sm_90a", nvcc, tmp_path, bf16=False)  # (a library per activation type)
    assert fp16 != lib and "sm_90a_fp16" in fp16.name


def test_no_configs_without_a_cuda_tensor_and_the_names() -> None:
    x = torch.zeros(1, 64, dtype=torch.bfloat16)
    w = torch.zeros(32, 64, dtype=torch.uint8).view(FP8)
    assert cuda_gemv.configs_for(w, x) == ()
    assert not cuda_gemv.supports(x, w)
    assert str(cuda_gemv.CudaConfig(16, 2, 4)) == "cuda_w16u2a4" and len(set(cuda_gemv.CONFIGS)) == 12
    assert str(cuda_gemv.CudaConfig(8, 4, 0, True)) == "cuda_w8u4a0p"
    assert cuda_gemv.CudaConfig(8, 2, 0) not in cuda_gemv.CONFIGS  # (never won a shape: docs/decisions/0007)
    assert all(c.unroll == 2 and c.ahead == 0 and c.pdl for c in cuda_gemv.CONFIGS if c.pipe)  # (what gemv.cu builds)
    assert cuda_gemv.arch_flag((9, 0)) == "sm_90a" and cuda_gemv.arch_flag((8, 9)) == "sm_89"


def test_the_kernel_cache_follows_the_environment(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("BANYAN_KERNEL_CACHE", str(tmp_path / "k"))
    assert cuda_gemv.cache_dir() == tmp_path / "k"
    monkeypatch.delenv("BANYAN_KERNEL_CACHE")
    monkeypatch.setenv("BANYAN_CACHE_DIR", str(tmp_path))
    assert cuda_gemv.cache_dir() == tmp_path / "kernels"


def test_the_mlp_takes_the_activation_from_the_gate_up_kernel_where_it_was_chosen(monkeypatch) -> None:
    """``GateUpParallelLinear.forward_silu_mul``: where the gate/up shape chose a kernel for its activation
    (``act_out``), the MLP feeds that kernel's (T, I) output to the down projection as is; else the projection,
    then the activation — the same result either way."""
    from services.worker import kernels
    from services.worker.models.config import DecoderConfig
    from services.worker.models.llama import LlamaMLP
    from services.worker.kernels.ops import TORCH_OPS, _torch_silu_and_mul, use_ops
    from services.worker.tp import TPGroup

    cfg = DecoderConfig(hidden_size=32, intermediate_size=48, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
                        vocab_size=64, max_positions=64, rms_norm_eps=1e-6, rope=None, tie_word_embeddings=False)
    with use_ops(TORCH_OPS):
        mlp = LlamaMLP(cfg, TPGroup())
    g = torch.Generator().manual_seed(0)
    for p in mlp.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g) / 8)
    x = torch.randn(2, 32, generator=g)
    want = mlp(x)
    assert mlp.gate_up_proj.forward_silu_mul(x) is None  # (no choice)
    made = []

    def fake(x, w, s, cfg, silu_mul=False, act_out=False):
        made.append(act_out)
        y = x @ w.t()
        return _torch_silu_and_mul(y) if act_out else y

    monkeypatch.setattr(kernels, "small_m_linear", fake)
    monkeypatch.setattr(kernels, "choices", {(96, 32, torch.float32, "act_out"): ((4, cuda_gemv.CudaConfig()),)})
    assert torch.allclose(mlp(x), want, atol=1e-6) and made == [True]
    assert kernels.small_m_config(torch.zeros(5, 32), mlp.gate_up_proj.weight, act_out=True) is None  # (M 5: not)

