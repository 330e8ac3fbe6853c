"""Models, loader, reference attention and sampler against transformers on tiny random models."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig, PretrainedConfig, Qwen2Config, Qwen3Config
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from services.worker.attention.base import AttentionBatch
from services.worker.attention.torch_backend import TorchAttention
from services.worker.kv_pool import KVPool, pool_slots_for_memory
from services.worker.tp import TPGroup
from services.worker.models.loader import ModelSpec, load_model
from services.worker.models.rotary import RopeConfig
from services.worker.sampling.draw import TokenSampler
from shared.messages.common import SamplingParams

TINY = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
    intermediate_size=128,
    max_position_embeddings=128,
)
LLAMA3_ROPE = dict(
    rope_type="llama3",
    rope_theta=500000.0,
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=16,
)
TINY_VARIANTS: dict[str, tuple[type[PretrainedConfig], dict[str, object]]] = {
    "llama": (LlamaConfig, {"rope_parameters": LLAMA3_ROPE, "tie_word_embeddings": False}),
    "qwen2": (Qwen2Config, {"tie_word_embeddings": True}),  # qkv bias
    "qwen3": (Qwen3Config, {"head_dim": 32, "tie_word_embeddings": True}),  # qk-norm, head_dim != 64 / 4
}


def tiny_config(arch: str, **overrides: object) -> PretrainedConfig:
    config_class, variant = TINY_VARIANTS[arch]
    return config_class(**{**TINY, **variant, **overrides})


def save_tiny_model(config: PretrainedConfig, path: Path) -> torch.nn.Module:
    """A random fp32 HF model saved as safetensors; every parameter (norms, biases) perturbed."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path, safe_serialization=True)
    return model


class KVTable:
    """The runner's request table in miniature: shuffled slots per row, AttentionBatch per step."""

    def __init__(self, num_slots: int, num_rows: int = 4, max_context: int = 64) -> None:
        self.free = (torch.randperm(num_slots - 1, generator=torch.Generator().manual_seed(0)) + 1).tolist()
        self.req_to_token = torch.zeros(num_rows, max_context, dtype=torch.int32)
        self.lens = [0] * num_rows

    def batch(self, extends: list[tuple[int, int]]) -> AttentionBatch:
        """extends: (row, new tokens) per request, in batch order."""
        rows, prefixes, out_slots, positions = [], [], [], []
        for row, n in extends:
            prefix = self.lens[row]
            slots = [self.free.pop() for _ in range(n)]
            self.req_to_token[row, prefix : prefix + n] = torch.tensor(slots, dtype=torch.int32)
            self.lens[row] += n
            rows.append(row)
            prefixes.append(prefix)
            out_slots += slots
            positions += range(prefix, prefix + n)
        return AttentionBatch(
            req_to_token=self.req_to_token,
            rows=torch.tensor(rows),
            prefix_lens=torch.tensor(prefixes),
            extend_lens=torch.tensor([n for _, n in extends]),
            out_slots=torch.tensor(out_slots),
            positions=torch.tensor(positions),
            prefix_lens_cpu=prefixes,
            extend_lens_cpu=[n for _, n in extends],
        )


@torch.inference_mode()
def run_schedule(
    model_dir: Path, seqs: list[list[int]], chunks: list[list[int]], tp: TPGroup = TPGroup(),
    quantization: str = "", kv_dtype: torch.dtype | None = None, fp8_vocab: bool = False,
) -> list[torch.Tensor]:
    """Feed request r's tokens in chunk sizes chunks[r], one chunk per request per step while it
    has any left (so prefill chunks and decode steps mix); returns each request's (len, V) logits.
    ``quantization``, ``kv_dtype``: FP8 weights / KV pool (default scales)."""
    model, spec = load_model(model_dir, torch.float32, "cpu", tp, quantization=quantization, fp8_vocab=fp8_vocab)
    pool = KVPool(spec.num_layers, 256, spec.kv_heads_per_rank(tp.size), spec.head_dim, torch.float32, "cpu",
                  kv_dtype=kv_dtype)
    attn, table = TorchAttention(pool), KVTable(pool.num_slots)
    logits: list[list[torch.Tensor]] = [[] for _ in seqs]
    for step in range(max(map(len, chunks))):
        active = [r for r in range(len(seqs)) if step < len(chunks[r])]
        new_ids = [seqs[r][table.lens[r] : table.lens[r] + chunks[r][step]] for r in active]
        batch = table.batch([(r, len(ids)) for r, ids in zip(active, new_ids, strict=True)])
        input_ids = torch.tensor([t for ids in new_ids for t in ids])
        attn.prepare(batch)
        out = model.compute_logits(model(input_ids, batch.positions, attn))  # (T, V)
        for r, part in zip(active, out.split(batch.extend_lens_cpu), strict=True):
            logits[r].append(part)
    return [torch.cat(parts) for parts in logits]


def assert_close_rel(actual: torch.Tensor, expected: torch.Tensor, rel: float = 1e-4) -> None:
    err = (actual - expected).abs().max().item()
    assert err <= rel * expected.abs().max().item(), f"max abs error {err} vs scale {expected.abs().max().item()}"


def random_seqs(lengths: list[int], vocab: int = 512) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp(request.param)
    return path, save_tiny_model(tiny_config(request.param), path)


@torch.inference_mode()
def hf_logits(hf: torch.nn.Module, seq: list[int]) -> torch.Tensor:
    return hf(torch.tensor([seq])).logits[0].float()  # (len, V)


def test_prefill_batch_matches_hf(tiny: tuple[Path, torch.nn.Module]) -> None:
    path, hf = tiny
    seqs = random_seqs([5, 9, 1, 13])
    ours = run_schedule(path, seqs, [[len(s)] for s in seqs])  # one batch, four prompts
    for seq, logits in zip(seqs, ours, strict=True):
        assert_close_rel(logits, hf_logits(hf, seq))


def test_chunked_prefill_and_decode_match_hf(tiny: tuple[Path, torch.nn.Module]) -> None:
    path, hf = tiny
    seqs = random_seqs([20, 14, 9])
    chunks = [[6, 7] + [1] * 7, [3, 7, 1, 1, 1, 1], [1] * 9]
    for seq, logits in zip(seqs, run_schedule(path, seqs, chunks), strict=True):
        assert_close_rel(logits, hf_logits(hf, seq))


def test_spec_reads_config_and_generation_config(tmp_path: Path) -> None:
    save_tiny_model(tiny_config("llama", eos_token_id=2), tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    spec = ModelSpec.from_dir(tmp_path)
    assert spec == ModelSpec("LlamaForCausalLM", 2, 4, 2, 16, 64, 512, 128, (2, 7))
    assert spec.kv_heads_per_rank(2) == 1 and spec.kv_heads_per_rank(4) == 1


def test_missing_weights_and_unknown_architecture_are_named(tmp_path: Path) -> None:
    save_tiny_model(tiny_config("qwen3"), tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.layers.1.self_attn.k_proj.weight"], weights["model.layers.0.self_attn.k_norm.weight"]
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"k_norm.weight, model.layers.1.self_attn.qkv_proj.weight \(shard k\)"):
        load_model(tmp_path, torch.float32, "cpu")

    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM"):
        ModelSpec.from_dir(tmp_path)


def test_pool_slots_for_memory() -> None:
    assert pool_slots_for_memory(2 * 3 * 4 * 8 * 2 * 100 + 5, 3, 4, 8, torch.bfloat16) == 100


# --- sampler ---------------------------------------------------------------------------------


def sample_n(sampler: TokenSampler, logits: torch.Tensor, params: SamplingParams, n: int) -> torch.Tensor:
    return sampler.sample(logits.expand(n, -1).contiguous(), [params] * n, [None] * n)


def test_greedy_is_argmax() -> None:
    logits = torch.randn(5, 100, generator=torch.Generator().manual_seed(0))
    sampler = TokenSampler()
    for params in (SamplingParams(temperature=0.0), SamplingParams(top_k=1), SamplingParams(top_p=1e-6)):
        assert torch.equal(sampler.sample(logits, [params] * 5, [None] * 5), logits.argmax(-1))


def test_seeded_sampling_is_reproducible_across_batches() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=g)
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=20, seed=7)
    sampler = TokenSampler(seed=3)

    def draws(seed: int, batch_size: int) -> list[int]:
        gen = torch.Generator().manual_seed(seed)
        others = [SamplingParams(), SamplingParams(temperature=0.0), SamplingParams(seed=99)][: batch_size - 1]
        generators = [gen, None, torch.Generator().manual_seed(99)][:batch_size]
        return [sampler.sample(logits[:batch_size], [params, *others], generators)[0].item() for _ in range(30)]

    assert draws(7, 1) == draws(7, 3) == draws(7, 2)
    assert draws(7, 1) != draws(8, 1)


def test_filters_restrict_the_support() -> None:
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    sampler = TokenSampler()
    assert set(sample_n(sampler, logits, SamplingParams(min_p=0.5), 2000).tolist()) == {0, 1}
    assert set(sample_n(sampler, logits, SamplingParams(top_k=3), 2000).tolist()) == {0, 1, 2}
    assert set(sample_n(sampler, logits, SamplingParams(top_p=0.7), 2000).tolist()) == {0, 1}
    assert set(sample_n(sampler, logits, SamplingParams(), 2000).tolist()) == {0, 1, 2, 3}
    hot = sample_n(sampler, logits, SamplingParams(temperature=100.0), 4000).bincount(minlength=4)
    assert hot.min() > 800  # nearly uniform


# --- rope ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "hf",
    [
        {"rope_parameters": LLAMA3_ROPE},
        {"rope_theta": 500000.0, "rope_scaling": {"type": "linear", "factor": 4.0}},  # pre-5 style
        {"rope_theta": 1e6, "rope_scaling": None},
    ],
)
def test_rope_inv_freq_matches_transformers(hf: dict[str, object]) -> None:
    expected = LlamaRotaryEmbedding(LlamaConfig(**TINY, **hf)).inv_freq
    assert torch.equal(RopeConfig.from_hf(hf).inv_freq(16), expected)


def test_unsupported_rope_type_is_named() -> None:
    with pytest.raises(NotImplementedError, match="rope type 'dynamic' is not supported"):
        RopeConfig.from_hf({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}})
