"""FP8 weights on the CPU: the numerics, every checkpoint layout loaded exactly (the FP8 values and
scales the checkpoint holds), logits against HF transformers in fp32 within stated bounds, online
quantization (--quantization fp8), and unsupported quantization configs refused by name.

Bounds (measured on these tiny random models: rel. error 0.10–0.13, top-1 agreement 0.91–1.0):
the logits' relative error ‖ours − HF‖ / ‖HF‖ ≤ 0.2, and the top-1 token agrees with HF's on
≥ 85 % of the positions where HF's top-2 margin is ≥ 0.1. Greedy identity is not expected.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tests.worker.fp8_checkpoints import LAYOUTS, dequantized, make_fp8_checkpoint, with_quantization_config
from tests.worker.test_models import hf_logits, random_seqs, run_schedule, save_tiny_model, tiny_config

from services.worker.models.loader import load_model
from services.worker.quant.fp8 import FP8, fp8_linear, quantize_per_token, quantize_rows

REL_ERR, TOP1, MARGIN = 0.2, 0.85, 0.1


def logits_agreement(ours: torch.Tensor, ref: torch.Tensor, margin: float = MARGIN) -> tuple[float, float, int]:
    """(relative error, top-1 agreement on positions whose reference top-2 margin ≥ margin, their count)."""
    rel = ((ours - ref).norm() / ref.norm()).item()
    top2 = ref.topk(2, -1).values
    sure = (top2[:, 0] - top2[:, 1]) >= margin
    return rel, (ours.argmax(-1) == ref.argmax(-1))[sure].float().mean().item(), int(sure.sum())


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def tiny(request, tmp_path_factory) -> tuple[str, Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp(request.param)
    return request.param, path, save_tiny_model(tiny_config(request.param), path)


# --- numerics ------------------------------------------------------------------------------------


def test_quantize_rows_and_tokens() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 80, generator=g) * torch.logspace(-2, 2, 48)[:, None]
    w[3] = 0
    q, s = quantize_rows(w)
    assert q.dtype == FP8 and s.shape == (48,)
    assert torch.equal(q.float().abs().amax(1)[torch.arange(48) != 3], torch.full((47,), 448.0))  # each row's max
    assert (q[3].float() == 0).all()
    err = (q.float() * s[:, None] - w).norm(dim=1) / w.norm(dim=1).clamp(min=1e-30)
    assert err[torch.arange(48) != 3].max() < 0.04  # e4m3: 3 mantissa bits, ≤ 6.25 % per element
    xq, xs = quantize_per_token(torch.tensor([[1.0, -896.0, 3.0], [0.0, 0.0, 0.0]]))
    assert xs.shape == (2, 1) and xs[0, 0] == 2.0 and xq[0].float().tolist() == [0.5, -448.0, 1.5]
    assert (xq[1].float() == 0).all()


def test_fp8_linear_is_the_dequantized_product() -> None:
    g = torch.Generator().manual_seed(1)
    w, x, b = torch.randn(32, 64, generator=g), torch.randn(5, 64, generator=g), torch.randn(32, generator=g)
    q, s = quantize_rows(w)
    xq, xs = quantize_per_token(x)
    want = (xq.double() * xs.double()) @ (q.double() * s.double()[:, None]).T + b.double()
    torch.testing.assert_close(fp8_linear(x, q, s, b).double(), want, rtol=1e-5, atol=1e-5)
    exact = x @ w.T + b
    assert (fp8_linear(x, q, s, b) - exact).norm() / exact.norm() < 0.06


# --- checkpoints ----------------------------------------------------------------------------------


def _dequantized_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name.removesuffix(".weight"): m.weight.float() * m.weight_scale[:, None]
            for name, m in model.named_modules() if getattr(m, "fp8", False)}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fp8_checkpoint_loads_exactly_and_matches_hf(tiny, layout, tmp_path) -> None:
    arch, src, hf = tiny
    ckpt = make_fp8_checkpoint(src, tmp_path / layout, layout)
    model, _ = load_model(ckpt, torch.float32, "cpu")
    assert model.quant is not None and model.quant.block == ((32, 16) if layout.endswith("block") else None)
    assert model.lm_head.weight.dtype == model.model.embed_tokens.weight.dtype == torch.float32
    got = _dequantized_params(model)
    assert len(got) == 4 * model.config.num_layers  # qkv, o, gate_up, down
    saved = dequantized(ckpt)
    for i in range(model.config.num_layers):
        p = f"model.layers.{i}"
        fused = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                 "self_attn.o_proj": ("self_attn.o_proj",), "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
                 "mlp.down_proj": ("mlp.down_proj",)}
        for ours, parts in fused.items():
            want = torch.cat([saved[f"{p}.{part}.weight"] for part in parts])
            if layout.endswith("block"):  # re-quantized per row from the block-wise values: one more rounding
                assert (got[f"{p}.{ours}"] - want).norm() / want.norm() < 0.04
            else:  # the checkpoint's own FP8 values and scales
                torch.testing.assert_close(got[f"{p}.{ours}"], want, rtol=0, atol=0)
    seqs = random_seqs([30, 17, 9])
    ours = torch.cat(run_schedule(ckpt, seqs, [[12, 18], [17], [4, 1, 1, 1, 1, 1]]))
    rel, top1, n = logits_agreement(ours, torch.cat([hf_logits(hf, s) for s in seqs]))
    assert n >= 20 and rel <= REL_ERR and top1 >= TOP1, (arch, layout, rel, top1, n)


def test_online_quantization_matches_hf_and_halves_weight_bytes(tiny) -> None:
    arch, src, hf = tiny
    model, _ = load_model(src, torch.float32, "cpu", quantization="fp8")
    assert model.quant is not None and model.quant.source == "online"
    full, _ = load_model(src, torch.float32, "cpu")
    linear = lambda m: sum(p.numel() * p.element_size() for n, p in m.named_parameters() if "proj" in n)  # noqa: E731
    assert linear(model) < linear(full) * 0.3  # fp32 → e4m3 (+ one fp32 scale per row)
    for name, w in _dequantized_params(model).items():
        ref = dict(full.named_parameters())[name + ".weight"]
        assert (w - ref).norm() / ref.norm() < 0.04, name
    seqs = random_seqs([25, 11])
    ours = torch.cat(run_schedule(src, seqs, [[25], [5, 6]], quantization="fp8"))
    rel, top1, n = logits_agreement(ours, torch.cat([hf_logits(hf, s) for s in seqs]))
    assert n >= 12 and rel <= REL_ERR and top1 >= TOP1, (arch, rel, top1, n)


def test_fp8_vocab_quantizes_the_embeddings_and_lm_head_too(tiny) -> None:
    arch, src, hf = tiny
    model, _ = load_model(src, torch.float32, "cpu", quantization="fp8", fp8_vocab=True)
    linears_only, _ = load_model(src, torch.float32, "cpu", quantization="fp8")
    full, _ = load_model(src, torch.float32, "cpu")
    emb, head = model.model.embed_tokens, model.lm_head
    assert emb.weight.dtype == head.weight.dtype == FP8 and emb.weight_scale.dtype == torch.float32
    assert (head.weight is emb.weight and head.weight_scale is emb.weight_scale) == hf.config.tie_word_embeddings
    for mine, ref in ((emb, full.model.embed_tokens), (head, full.lm_head)):
        deq = mine.weight.float() * mine.weight_scale[:, None]
        assert (deq - ref.weight).norm() / ref.weight.norm() < 0.04
    ids = torch.tensor([0, 7, hf.config.vocab_size - 1])
    assert torch.equal(emb(ids), (emb.weight.float() * emb.weight_scale[:, None])[ids])  # rows dequantized
    size = lambda m: sum(p.numel() * p.element_size() for p in m.parameters())  # noqa: E731 (tied ones once)
    assert size(model) < size(linears_only) < size(full)
    seqs = random_seqs([25, 11])
    ours = torch.cat(run_schedule(src, seqs, [[25], [5, 6]], quantization="fp8", fp8_vocab=True))
    rel, top1, n = logits_agreement(ours, torch.cat([hf_logits(hf, s) for s in seqs]))
    assert n >= 12 and rel <= REL_ERR and top1 >= TOP1, (arch, rel, top1, n)
    with pytest.raises(ValueError, match="fp8-vocab needs FP8 weights"):
        load_model(src, torch.float32, "cpu", fp8_vocab=True)


def test_layers_the_checkpoint_left_unquantized_are_quantized_at_load(tiny, tmp_path) -> None:
    _, src, hf = tiny
    ckpt = make_fp8_checkpoint(src, tmp_path / "ct", "ct-channel", keep=r"layers\.0\.mlp\.down_proj")
    model, _ = load_model(ckpt, torch.float32, "cpu")
    down = model.model.layers[0].mlp.down_proj
    assert down.weight.dtype == FP8
    ref = hf.model.layers[0].mlp.down_proj.weight
    assert (down.weight.float() * down.weight_scale[:, None] - ref).norm() / ref.norm() < 0.04


# --- refusals -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("qc,message", [
    ({"quant_method": "awq", "bits": 4, "group_size": 128}, "'awq' is not supported"),
    ({"quant_method": "gptq", "bits": 4}, "'gptq' is not supported"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "'bitsandbytes' is not supported"),
    ({"load_in_8bit": True}, r"'\(no quant_method\)' is not supported"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "fmt 'e5m2' is not supported"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "group"}}}},
     "4-bit int weights"),
    ({"quant_method": "compressed-tensors", "config_groups": {"group_0": {
        "weights": {"num_bits": 8, "type": "float", "strategy": "group"}}}}, "strategy 'group'"),
])
def test_unsupported_quantization_is_refused_by_name(tiny, tmp_path, qc, message) -> None:
    _, src, _ = tiny
    with pytest.raises(ValueError, match=message):
        load_model(with_quantization_config(src, tmp_path / "m", qc), torch.float32, "cpu")


def test_inconsistent_fp8_checkpoints_are_refused(tiny, tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    _, src, _ = tiny
    ckpt = make_fp8_checkpoint(src, tmp_path / "blk", "fp8-block")
    cfg_path = ckpt / "config.json"
    cfg = cfg_path.read_text().replace('"weight_block_size"', '"unused_block_size"')
    cfg_path.write_text(cfg)
    with pytest.raises(ValueError, match="block-wise shape .* no block size"):
        load_model(ckpt, torch.float32, "cpu")
    ckpt = make_fp8_checkpoint(src, tmp_path / "ch", "fp8-channel")
    tensors = load_file(ckpt / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight_scale"]
    save_file(tensors, ckpt / "model.safetensors")
    with pytest.raises(ValueError, match=r"up_proj.weight' is FP8 but has no .*weight_scale"):
        load_model(ckpt, torch.float32, "cpu")


def test_fused_quantization_runs_the_same_math_through_the_ops_that_make_the_activations(tiny) -> None:
    """``FusedQuant``: the q/k/v and gate/up inputs quantized by the norm before them, down's by the activation —
    the same numbers as each linear quantizing its own input (bit for bit with the reference ops), each op called
    once a layer a step; ``BANYAN_FP8_FUSED_QUANT=0``'s path (None) gives the same logits too."""
    from services.worker.quant import fp8 as fp8_mod
    from services.worker.quant.fp8 import FusedQuant, QuantizedActivation

    arch, src, _ = tiny
    seqs, chunks = random_seqs([13, 7]), [[13], [4, 3]]
    calls = {"norm": 0, "silu": 0}

    def norm(x, residual, w, eps):
        calls["norm"] += 1
        h, r = (x + residual, x + residual) if residual is not None else (x, x)
        y = w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
        return QuantizedActivation(*quantize_per_token(y), x.dtype), r

    def silu(h):
        calls["silu"] += 1
        gate, up = h.chunk(2, dim=-1)
        return QuantizedActivation(*quantize_per_token(torch.nn.functional.silu(gate) * up), h.dtype)

    saved = fp8_mod.fused_quant()
    try:
        runs = {}
        for name, fused in (("off", None), ("ops", FusedQuant(None, None)), ("fused", FusedQuant(norm, silu))):
            fp8_mod.set_fused_quant(fused)
            runs[name] = torch.cat(run_schedule(src, seqs, chunks, quantization="fp8"))
    finally:
        fp8_mod.set_fused_quant(saved)
    layers = tiny_config(arch).num_hidden_layers
    assert calls == {"norm": 2 * layers * 2, "silu": layers * 2}, calls  # (two steps: 2 norms + 1 activation a layer)
    assert torch.equal(runs["off"], runs["ops"]), arch
    assert torch.equal(runs["off"], runs["fused"]), arch


def test_a_linear_lets_the_op_before_it_quantize_only_where_it_takes_the_library_gemm(monkeypatch) -> None:
    """``_Linear.quantizes``: FP8, fused quantization on, and no small-M kernel for its shape at x's rows — plain, or
    of the kinds its caller tries first (the down projection's activation-reading kernel, gate/up's activation-making
    one): there the small-M kernels read unquantized activations, so the op before must not quantize them."""
    from services.worker import kernels
    from services.worker.models.layers import RowParallelLinear
    from services.worker.quant import fp8 as fp8_mod
    from services.worker.quant import fp8_linears
    from services.worker.quant.fp8 import FusedQuant
    from services.worker.tp import TPGroup

    with fp8_linears(True):
        down = RowParallelLinear(64, 32, bias=False, tp=TPGroup())
    plain = RowParallelLinear(64, 32, bias=False, tp=TPGroup())
    monkeypatch.setattr(kernels, "choices", {})
    monkeypatch.setattr(fp8_mod, "_fused", FusedQuant(None, None))
    x4, x20 = torch.randn(4, 64), torch.randn(20, 64)
    assert down.quantizes(x4) and down.quantizes(x20) and not plain.quantizes(x4)  # (no choices: the library)
    kernels.choices[(32, 64, FP8, "silu_mul")] = ((4, "fused_read"),)  # (the down projection's kind, to M = 4)
    assert down.quantizes(x4)  # (a caller that does not try that kind)
    assert not down.quantizes(x4, "silu_mul") and down.quantizes(x20, "silu_mul")
    kernels.choices[(32, 64, FP8)] = ((kernels.MAX_M, "plain"),)
    assert not down.quantizes(x4) and not down.quantizes(torch.randn(16, 64)) and down.quantizes(x20)
    monkeypatch.setattr(fp8_mod, "_fused", None)  # (BANYAN_FP8_FUSED_QUANT=0)
    assert not down.quantizes(x20)
