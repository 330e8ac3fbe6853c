"""The embedded demo model: served when no ``--model`` is given.

A tiny ``LlamaForCausalLM`` with seeded random weights and a byte-level BPE tokenizer trained on
``banyan.demo_corpus``. Nothing is downloaded: :func:`ensure_demo_model` builds the HF-format
directory once (well under a second of CPU) and caches it. Its output is gibberish, but it exercises
the whole serving path (chat template, multi-byte detokenization, stop tokens, paged attention) with
real shapes (GQA, RoPE, SwiGLU).

Cache location: ``cache_dir`` argument, else ``$BANYAN_CACHE_DIR``, else ``$XDG_CACHE_HOME/banyan``,
else ``~/.cache/banyan``; the model lives in ``demo-model-<version>/``. The version hashes the
builder's inputs (corpus, architecture, template, seed, tokenizers and torch release lines), so any
change builds a new directory instead of reusing a stale one. Builds happen in a private temp directory that is renamed into place, so
concurrent processes never see a half-written model; when two race, the first rename wins and the
loser discards its copy.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import tokenizers
import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from banyan.demo_corpus import CORPUS
from shared.model_path import cache_root

__all__ = ["CHAT_TEMPLATE", "DEMO_FILES", "SPECIAL_TOKENS", "demo_cache_root", "demo_version", "ensure_demo_model"]

_FORMAT_VERSION = 1  # bump when the builder changes in a way the hashed inputs below do not capture
_BUILD_PREFIX = ".demo-build-"
_TRASH_PREFIX = ".demo-trash-"
_STALE_S = 3600.0  # temp dirs older than this are leftovers of crashed builds

BOS, EOS_TEXT, IM_START, IM_END, PAD = (
    "<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>", "<|pad|>",
)
SPECIAL_TOKENS: tuple[str, ...] = (BOS, EOS_TEXT, IM_START, IM_END, PAD)  # ids 0..4, in this order
VOCAB_SIZE = 2000
SEED = 0
EMBED_STD = 0.02
PROJ_STD = 0.08  # logit std ~1.3, median top-1/top-2 gap ~0.25: greedy decoding is rarely a near-tie

ARCH: dict[str, object] = {
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 32,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "mlp_bias": False,
    "initializer_range": EMBED_STD,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "use_cache": True,
}

# ChatML. The BOS comes from the template, so rendered prompts are tokenized without special tokens
# (as ``apply_chat_template(tokenize=True)`` does); plain text gets its BOS from the post-processor.
# With ``tools`` it renders them, assistant tool calls and tool results the way Qwen2.5's template does
# (Hermes' ``<tool_call>`` format: the tool call parser detects it), so the demo shows tool calling.
_CONTENT = (
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- elif message['content'] -%}{%- for part in message['content'] if part['type'] == 'text' -%}"
    "{{- part['text'] -}}{%- endfor -%}{%- endif -%}"
)
CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if messages[0]['role'] == 'system' -%}{%- set message = messages[0] -%}" + _CONTENT + "{{- '\\n\\n' -}}"
    "{%- endif -%}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided "
    "with function signatures within <tools></tools> XML tags:\\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' -}}{{- tool | tojson -}}{%- endfor -%}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if tools and loop.first and message['role'] == 'system' -%}"
    "{%- elif message['role'] == 'tool' -%}"
    "{{- '<|im_start|>tool\\n<tool_response>\\n' -}}" + _CONTENT + "{{- '\\n</tool_response><|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}" + _CONTENT +
    "{%- for call in message['tool_calls'] or [] -%}"
    "{%- if message['content'] or not loop.first -%}{{- '\\n' -}}{%- endif -%}"
    "{{- '<tool_call>\\n{\"name\": \"' + call['function']['name'] + '\", \"arguments\": ' -}}"
    "{%- if call['function']['arguments'] is string -%}{{- call['function']['arguments'] -}}"
    "{%- else -%}{{- call['function']['arguments'] | tojson -}}{%- endif -%}"
    "{{- '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

DEMO_FILES: tuple[str, ...] = (
    "config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
)


def demo_version() -> str:
    """Version key of the demo model: changes whenever any input of the build changes."""
    h = hashlib.sha256()
    # BPE training and torch's RNG are only guaranteed stable within a library release line.
    libs = [".".join(v.split(".")[:2]) for v in (tokenizers.__version__, torch.__version__)]
    spec = [_FORMAT_VERSION, libs, SPECIAL_TOKENS, VOCAB_SIZE, SEED, EMBED_STD, PROJ_STD, ARCH, CHAT_TEMPLATE]
    h.update(json.dumps(spec, sort_keys=True).encode())
    for section in CORPUS:
        h.update(section.encode())
    return f"v{_FORMAT_VERSION}-{h.hexdigest()[:12]}"


def demo_cache_root(cache_dir: str | None = None) -> Path:
    """The cache root: argument, ``$BANYAN_CACHE_DIR``, ``$XDG_CACHE_HOME/banyan``, ``~/.cache/banyan``."""
    return Path(cache_dir).expanduser() if cache_dir else cache_root()


def ensure_demo_model(cache_dir: str | None = None) -> str:
    """Return the demo model's HF directory, building it on first use. Safe to call concurrently."""
    root = demo_cache_root(cache_dir)
    final = root / f"demo-model-{demo_version()}"
    if _is_complete(final):
        return str(final)
    root.mkdir(parents=True, exist_ok=True)
    # A directory only ever appears there complete (by rename), so an incomplete one is damaged
    # (e.g. a file deleted by hand). Re-check: another process may have just renamed its build in.
    if final.exists() and not _is_complete(final):
        _discard(final, root)
    _remove_stale_temps(root)
    tmp = Path(tempfile.mkdtemp(prefix=_BUILD_PREFIX, dir=root))
    try:
        _build_into(tmp)
        _make_readable(tmp)
        try:
            os.rename(tmp, final)  # atomic; fails if another process got there first
        except OSError:
            if not _is_complete(final):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # no-op after a successful rename
    return str(final)


def _is_complete(path: Path) -> bool:
    return all((path / name).is_file() for name in DEMO_FILES)


def _make_readable(path: Path) -> None:
    """mkdtemp (and safetensors) create owner-only modes; a shared cache must be readable by all."""
    path.chmod(0o755)
    for f in path.iterdir():
        f.chmod(0o644)


def _discard(path: Path, root: Path) -> None:
    trash = root / f"{_TRASH_PREFIX}{os.getpid()}-{time.monotonic_ns()}"
    try:
        os.rename(path, trash)
    except FileNotFoundError:  # another process moved it already
        return
    shutil.rmtree(trash, ignore_errors=True)


def _remove_stale_temps(root: Path) -> None:
    now = time.time()
    for entry in root.iterdir():
        if entry.name.startswith((_BUILD_PREFIX, _TRASH_PREFIX)):
            try:
                if now - entry.stat().st_mtime > _STALE_S:
                    shutil.rmtree(entry, ignore_errors=True)
            except FileNotFoundError:
                pass


def _build_into(path: Path) -> None:
    """Write every file of the demo model into the (empty) directory ``path``."""
    tokenizer = _train_tokenizer()
    ids = {tok: tokenizer.token_to_id(tok) for tok in SPECIAL_TOKENS}
    vocab_size = tokenizer.get_vocab_size()
    tokenizer.save(str(path / "tokenizer.json"))
    _write_json(path / "tokenizer_config.json", _tokenizer_config(ids))
    eos_ids = [ids[IM_END], ids[EOS_TEXT]]
    token_ids = {"bos_token_id": ids[BOS], "eos_token_id": eos_ids, "pad_token_id": ids[PAD]}
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab_size}
    _write_json(path / "config.json", {**config, **ARCH, **token_ids})
    _write_json(path / "generation_config.json", {**token_ids, "do_sample": False})
    save_file(_random_weights(vocab_size), str(path / "model.safetensors"), metadata={"format": "pt"})


def _train_tokenizer() -> Tokenizer:
    """Byte-level BPE over the corpus; deterministic (same corpus → same vocab and merges)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=1,
        show_progress=False,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes: any text encodes
    )
    tokenizer.train_from_iterator(CORPUS, trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS}:1 $B:1", special_tokens=[(BOS, bos_id)]
    )
    return tokenizer


def _tokenizer_config(ids: dict[str, int]) -> dict:
    added = {
        str(i): {"content": tok, "lstrip": False, "normalized": False, "rstrip": False,
                 "single_word": False, "special": True}
        for tok, i in ids.items()
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": IM_END,
        "pad_token": PAD,
        "model_max_length": ARCH["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": added,
        "chat_template": CHAT_TEMPLATE,
    }


def _random_weights(vocab_size: int) -> dict[str, torch.Tensor]:
    """Seeded N(0, std) matrices in a fixed order; RMSNorm weights are ones."""
    g = torch.Generator().manual_seed(SEED)
    hidden, inter = ARCH["hidden_size"], ARCH["intermediate_size"]
    q_dim = ARCH["num_attention_heads"] * ARCH["head_dim"]
    kv_dim = ARCH["num_key_value_heads"] * ARCH["head_dim"]

    def normal(rows: int, cols: int, std: float) -> torch.Tensor:
        return torch.randn(rows, cols, generator=g, dtype=torch.float32) * std

    w = {"model.embed_tokens.weight": normal(vocab_size, hidden, EMBED_STD)}
    for i in range(ARCH["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = torch.ones(hidden)
        w[p + "self_attn.q_proj.weight"] = normal(q_dim, hidden, PROJ_STD)
        w[p + "self_attn.k_proj.weight"] = normal(kv_dim, hidden, PROJ_STD)
        w[p + "self_attn.v_proj.weight"] = normal(kv_dim, hidden, PROJ_STD)
        w[p + "self_attn.o_proj.weight"] = normal(hidden, q_dim, PROJ_STD)
        w[p + "post_attention_layernorm.weight"] = torch.ones(hidden)
        w[p + "mlp.gate_proj.weight"] = normal(inter, hidden, PROJ_STD)
        w[p + "mlp.up_proj.weight"] = normal(inter, hidden, PROJ_STD)
        w[p + "mlp.down_proj.weight"] = normal(hidden, inter, PROJ_STD)
    w["model.norm.weight"] = torch.ones(hidden)
    w["lm_head.weight"] = normal(vocab_size, hidden, PROJ_STD)
    return w


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
