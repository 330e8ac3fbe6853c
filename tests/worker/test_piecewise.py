"""Piecewise graphs' decomposition (``services/worker/piecewise.py``) on the CPU: the pieces between
attentions, run in place of their graphs (``capture=False``), give the model's own forward — every
step kind (fresh prompts, prefix + decodes + a chunk, decodes), padded to each captured size, with a
Llama and a Qwen3 (q/k norms) model through the torch attention backend. The capture itself needs
CUDA: tests/gpu/test_gpu_parity.py replays the graphs against eager steps."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.worker.attention.base import AttentionBatch
from services.worker.attention.torch_backend import TorchAttention
from services.worker.kv_pool import KVPool
from services.worker.models import model_class
from services.worker.piecewise import PiecewiseGraphs, token_sizes
from services.worker.tp import TPGroup

HF = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
          vocab_size=300, max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10000.0)


def test_token_sizes_pad_by_at_most_a_quarter_above_128() -> None:
    sizes = token_sizes(1024)
    assert sizes[:5] == [16, 32, 64, 96, 128] and sizes[-1] == 1024 and sizes == sorted(set(sizes))
    assert all(b <= a * 1.25 for a, b in zip(sizes[4:], sizes[5:], strict=False))
    assert token_sizes(100)[-1] == 100 and token_sizes(16) == [16]


def _model(arch: str):
    torch.manual_seed(0)
    hf = dict(HF, head_dim=16) if arch == "Qwen3ForCausalLM" else HF
    cls = model_class(arch)
    cfg = cls.parse_config(hf)
    model = cls(cfg, TPGroup())
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return model, cfg


@pytest.mark.parametrize("write", [True, False], ids=["pieces_write_kv", "attention_writes_kv"])
@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3ForCausalLM"])
def test_pieces_equal_the_forward(arch, write) -> None:
    """``write``: the pieces rotate q/k and write the KV (the runner's way), padding rows into slot 0 only;
    else the attention does, as in the model's forward."""
    model, cfg = _model(arch)
    model.eval()
    table = torch.zeros(5, 128, dtype=torch.int32)
    table[:4] = (torch.randperm(4 * 128) + 1)[: 4 * 128].view(4, 128).int()
    steps = [[(0, 30), (0, 9)], [(30, 1), (9, 20), (0, 3)], [(31, 1), (29, 1), (3, 1)]]  # (prefix, extend)
    gen = torch.Generator().manual_seed(1)
    pools = []
    for use_pieces in (False, True):
        pool = KVPool(cfg.num_layers, 600, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
        pools.append(pool)
        pieces = PiecewiseGraphs(model, 64, torch.device("cpu"), torch.float32, capture=False,
                                 pool=pool if write else None)
        assert pieces.size_for(1) == 16 and pieces.size_for(40) == 64 and pieces.size_for(65) is None
        attn, outs = TorchAttention(pool), []
        gen.manual_seed(1)
        for step in steps:
            rows = torch.arange(len(step))
            positions = torch.cat([torch.arange(p, p + e) for p, e in step])
            tok_rows = rows.repeat_interleave(torch.tensor([e for _, e in step]))
            batch = AttentionBatch(req_to_token=table, rows=rows, prefix_lens=torch.tensor([p for p, _ in step]),
                                   extend_lens=torch.tensor([e for _, e in step]),
                                   out_slots=table[tok_rows, positions].long(), positions=positions,
                                   prefix_lens_cpu=[p for p, _ in step], extend_lens_cpu=[e for _, e in step])
            ids = torch.randint(0, cfg.vocab_size, (len(positions),), generator=gen)
            attn.prepare(batch)
            with torch.inference_mode():
                if use_pieces:
                    outs.append(pieces.forward(ids, positions, attn, slots=batch.out_slots).clone())
                else:
                    outs.append(model.forward(ids, positions, attn).clone())
        if not use_pieces:
            want = outs
    for got, ref in zip(outs, want, strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    for layer in range(cfg.num_layers):  # the same KV in every slot but the padding slot 0
        for a, b in ((pools[0].k[layer], pools[1].k[layer]), (pools[0].v[layer], pools[1].v[layer])):
            torch.testing.assert_close(a[1:], b[1:], rtol=1e-5, atol=1e-5)
    if write:
        with pytest.raises(ValueError, match="slots"):
            pieces.forward(ids, positions, attn)


def test_step_kinds_name_piecewise_steps() -> None:
    from services.worker.runner import step_kind

    d, m, p = np.array([1, 1]), np.array([1, 30]), np.array([30, 9])
    assert [step_kind(x, graph=False) for x in (d, m, p)] == ["decode_eager", "mixed", "prefill"]
    assert step_kind(d, graph=True) == "decode_graph" and step_kind(d, graph=True, pieces=False) == "decode_graph"
    assert [step_kind(x, graph=False, pieces=True) for x in (d, m, p)] == [
        "decode_piecewise", "mixed_piecewise", "prefill_piecewise"]
