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
    assert str(cuda_gemv.CudaConfig(16, 2, 4)) == "cuda_w16u2a4" and len(set(cuda_gemv.CONFIGS)) == 13
    assert str(cuda_gemv.CudaConfig(8, 4, 0, True)) == "cuda_w8u4a0p"
    assert str(cuda_gemv.NORM_CONFIG) == "cuda_w8u2a0pd" and cuda_gemv.NORM_CONFIG in cuda_gemv.CONFIGS
    assert all(c.unroll == 2 and c.ahead == 0 and c.pdl for c in cuda_gemv.CONFIGS if c.pipe)  # (what gemv.cu builds)
    assert cuda_gemv.arch_flag((9, 0)) == "sm_90a" and cuda_gemv.arch_flag((8, 9)) == "sm_89"


def test_the_kernel_cache_follows_the_environment(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("BANYAN_KERNEL_CACHE", str(tmp_path / "k"))
    assert cuda_gemv.cache_dir() == tmp_path / "k"
    monkeypatch.delenv("BANYAN_KERNEL_CACHE")
    monkeypatch.setenv("BANYAN_CACHE_DIR", str(tmp_path))
    assert cuda_gemv.cache_dir() == tmp_path / "kernels"


def test_the_fused_norm_is_taken_only_where_the_linear_runs_on_the_cuda_kernel(monkeypatch) -> None:
    """``RMSNorm.then``: the fused kernel only when it is on, x has ≤ 8 rows, the linear has no bias and its
    shape chose the CUDA kernel; else the norm, then the linear — the same results as before."""
    from services.worker import kernels
    from services.worker.kernels.small_m import Config
    from services.worker.models.layers import MergedColumnParallelLinear, RMSNorm
    from services.worker.models.ops import TORCH_OPS, use_ops
    from services.worker.tp import TPGroup

    g = torch.Generator().manual_seed(0)
    with use_ops(TORCH_OPS):
        norm = RMSNorm(64, 1e-6)
        lin = MergedColumnParallelLinear(64, [32, 32], False, TPGroup())
        biased = MergedColumnParallelLinear(64, [16, 16], True, TPGroup())
    for p in (norm.weight, lin.weight, biased.weight, biased.bias):
        p.data.copy_(torch.randn(p.shape, generator=g))
    x, r = torch.randn(3, 64, generator=g), torch.randn(3, 64, generator=g)
    want = lin(norm(x, r)[0]), x + r
    calls = []
    monkeypatch.setattr(kernels, "_norm_linear", lambda *a: calls.append(a) or ("fused", a[1]))
    monkeypatch.setattr(kernels, "choices", {})
    monkeypatch.setattr(kernels, "norm_fused", {(64, 64, torch.float32), (32, 64, torch.float32)})
    got = norm.then(lin, x, r)  # (no choice: the norm, then the linear)
    assert not calls and torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    plain = norm.then(lin, x)  # (no residual: x is the stream)
    assert plain[1] is x and torch.equal(plain[0], lin(norm(x)))
    kernels.choices[(64, 64, torch.float32)] = ((4, Config(32, 256)),)  # (a Triton config: not fused)
    assert kernels.try_norm_linear(x, r, norm.weight, 1e-6, lin.weight, None) is None and not calls
    kernels.choices[(64, 64, torch.float32)] = ((4, cuda_gemv.CudaConfig(8, 4, 0, True)),)
    assert norm.then(lin, x, r) == ("fused", r) and len(calls) == 1
    assert calls[0][2] is norm.weight and calls[0][4] is lin.weight and calls[0][5] is None
    biased_want = biased(norm(x, r)[0])
    kernels.choices[(32, 64, torch.float32)] = ((4, cuda_gemv.CudaConfig(8, 4, 0, True)),)
    assert kernels.try_norm_linear(x, r, norm.weight, 1e-6, biased.weight, None) == ("fused", r)
    monkeypatch.setattr(kernels, "small_m_linear", lambda x, w, s, cfg, silu=False, act=False: x @ w.t())  # (the CPU's)
    assert torch.allclose(norm.then(biased, x, r)[0], biased_want) and len(calls) == 2  # (a bias: not fused)
    nine = torch.randn(9, 64), torch.randn(9, 64)  # (9 rows: over the kernel's 8)
    assert torch.equal(norm.then(lin, *nine)[0], lin(norm(*nine)[0])) and len(calls) == 2
    kernels.norm_fused.discard((64, 64, torch.float32))  # (measured slower fused: apart)
    assert kernels.try_norm_linear(x, r, norm.weight, 1e-6, lin.weight, None) is None and len(calls) == 2
    kernels.norm_fused.add((64, 64, torch.float32))
    monkeypatch.setattr(kernels, "_norm_linear", None)  # (off)
    assert kernels.try_norm_linear(x, r, norm.weight, 1e-6, lin.weight, None) is None and len(calls) == 2


def test_the_mlp_takes_the_activation_from_the_gate_up_kernel_where_it_was_chosen(monkeypatch) -> None:
    """``GateUpParallelLinear.forward_silu_mul``: where the gate/up shape chose a kernel for its activation
    (``act_out``), the MLP feeds that kernel's (T, I) output to the down projection as is; else the projection,
    then the activation — the same result either way."""
    from services.worker import kernels
    from services.worker.models.config import DecoderConfig
    from services.worker.models.llama import LlamaMLP
    from services.worker.models.ops import TORCH_OPS, _torch_silu_and_mul, use_ops
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


def test_the_l2_chain_follows_the_models_order_over_the_cuda_kernels_linears(monkeypatch) -> None:
    """``kernels.chain_l2`` (opt-in): the linears whose shape chose the CUDA kernel at batch 1 — plain, with SiLU in
    the read (down) or the activation made as it stores (gate/up) — in the model's order (each layer's q/k/v,
    gate/up, down, then the lm_head), each linking up to the asked MiB (at most half the L2); off by default."""
    import types

    from services.worker import kernels
    from services.worker.kernels.small_m import Config
    from services.worker.models.config import DecoderConfig
    from services.worker.models.llama import LlamaForCausalLM
    from services.worker.models.ops import TORCH_OPS, use_ops
    from services.worker.models.rotary import RopeConfig
    from services.worker.tp import TPGroup

    cfg = DecoderConfig(hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                        vocab_size=256, max_positions=64, rms_norm_eps=1e-6, rope=RopeConfig(),
                        tie_word_embeddings=False)
    with use_ops(TORCH_OPS):
        model = LlamaForCausalLM(cfg, TPGroup())
    cuda = cuda_gemv.CudaConfig(8, 2, 0, True, True)
    monkeypatch.setattr(kernels, "choices", {
        (128, 64, torch.float32): ((1, cuda),),  # q/k/v
        (64, 64, torch.float32): ((1, Config(32, 256)),),  # o: a Triton config, not chained
        (192, 64, torch.float32, "act_out"): ((1, cuda),),  # gate/up with the activation
        (64, 96, torch.float32, "silu_mul"): ((1, cuda),),  # down with SiLU in its read
        (256, 64, torch.float32): ((1, cuda),),  # lm_head
    })
    made = []
    monkeypatch.setattr(cuda_gemv, "chain", lambda order, cap: made.append((order, cap)) or len(order))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: types.SimpleNamespace(L2_cache_size=60 << 20))
    monkeypatch.delenv("BANYAN_GEMV_L2_CHAIN", raising=False)
    assert kernels.chain_l2(model, torch.device("cpu")) == "off" and made == [([], 0)]
    monkeypatch.setenv("BANYAN_GEMV_L2_CHAIN", "40")
    assert kernels.chain_l2(model, torch.device("cpu")) == "7 linears, 30 MiB each"  # (capped at half the L2)
    layers = model.model.layers
    want = [w for layer in layers for w in (layer.self_attn.qkv_proj.weight, layer.mlp.gate_up_proj.weight,
                                            layer.mlp.down_proj.weight)] + [model.lm_head.weight]
    order, cap = made[-1]
    assert cap == 30 << 20 and [id(w) for w in order] == [id(w) for w in want]


def test_the_attention_prefetches_its_layers_o_projection_when_asked(monkeypatch) -> None:
    """``kernels.attention_l2`` (opt-in, ``BANYAN_L2_ATTN_MIB``): each layer's o projection weight, as its bytes
    (the same memory), capped at the asked MiB and cut to 16 bytes, keyed by the layer index the attention is
    called with, for graphs up to ``BANYAN_L2_ATTN_ROWS`` rows; off (and an earlier map dropped) otherwise, and
    nothing for a backend without a Triton decode."""
    import types

    from services.worker import kernels
    from services.worker.models.config import DecoderConfig
    from services.worker.models.llama import LlamaForCausalLM
    from services.worker.models.ops import TORCH_OPS, use_ops
    from services.worker.models.rotary import RopeConfig
    from services.worker.tp import TPGroup

    cfg = DecoderConfig(hidden_size=64, intermediate_size=96, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16,
                        vocab_size=256, max_positions=64, rms_norm_eps=1e-6, rope=RopeConfig(),
                        tie_word_embeddings=False)
    with use_ops(TORCH_OPS):
        model = LlamaForCausalLM(cfg, TPGroup()).to(torch.bfloat16)
    attn = types.SimpleNamespace(l2_after={0: "stale"}, l2_rows=4)
    monkeypatch.delenv("BANYAN_L2_ATTN_MIB", raising=False)
    assert kernels.attention_l2(model, attn) == "off" and attn.l2_after == {} and attn.l2_rows == 0
    assert kernels.attention_l2(model, object()).startswith("off")
    monkeypatch.setenv("BANYAN_L2_ATTN_MIB", "1")
    monkeypatch.setenv("BANYAN_L2_ATTN_ROWS", "2")
    assert kernels.attention_l2(model, attn) == "3 o projections, 1 MiB each, graphs up to 2 rows"
    assert attn.l2_rows == 2 and sorted(attn.l2_after) == [0, 1, 2]
    for i, layer in enumerate(model.model.layers):
        flat, n = attn.l2_after[i]
        w = layer.self_attn.o_proj.weight
        assert flat.dtype == torch.uint8 and flat.data_ptr() == w.data_ptr() and flat.numel() == w.numel() * 2
        assert n == 64 * 64 * 2  # (the whole weight: under 1 MiB)
    monkeypatch.setenv("BANYAN_L2_ATTN_MIB", "0")
    assert "after the attention: off" in kernels.chain_l2(model, torch.device("cpu"), attn) and attn.l2_after == {}
