"""The embedded demo model: builds offline, loads in transformers, caches, is deterministic."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from banyan import demo
from banyan.demo import DEMO_FILES, demo_cache_root, demo_version, ensure_demo_model

REPO = Path(__file__).resolve().parents[2]


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return Path(ensure_demo_model(str(tmp_path_factory.mktemp("cache"))))


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


def test_layout_and_config(model_dir, tokenizer):
    assert model_dir.name == f"demo-model-{demo_version()}"
    assert sorted(p.name for p in model_dir.iterdir()) == sorted(DEMO_FILES)
    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"]) == (256, 4, 768)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (8, 4)
    assert cfg["max_position_embeddings"] == 4096 and cfg["rope_theta"] == 10000.0
    assert cfg["tie_word_embeddings"] is False and cfg["torch_dtype"] == "float32"
    assert cfg["vocab_size"] == len(tokenizer) == 2000
    ids = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|end_of_text|>", "<|begin_of_text|>"])
    assert cfg["eos_token_id"] == ids[:2] and cfg["bos_token_id"] == ids[2]
    gen = json.loads((model_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == cfg["eos_token_id"]


def test_tokenizer(tokenizer):
    assert tokenizer.bos_token == "<|begin_of_text|>" and tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token == "<|pad|>"
    text = "Héllo, wörld! 你好 😀 def f(x): return x ** 2"
    ids = tokenizer(text).input_ids
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    assert tokenizer.decode(tokenizer("😀", add_special_tokens=False).input_ids) == "😀"
    # Special tokens in text are single ids; common English words are single tokens.
    assert tokenizer("<|im_end|>", add_special_tokens=False).input_ids == [tokenizer.eos_token_id]
    assert len(tokenizer(" the", add_special_tokens=False).input_ids) == 1


def test_chat_template(tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi!"}]},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|begin_of_text|><|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n"
    )
    without = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert text == without + "<|im_start|>assistant\n"
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1


def test_loads_in_transformers(model_dir, tokenizer):
    model, info = AutoModelForCausalLM.from_pretrained(model_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert model.config.eos_token_id == tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|end_of_text|>"])
    ids = torch.tensor([tokenizer("The lighthouse keeper climbed the steps").input_ids])
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], len(tokenizer))
    assert torch.isfinite(logits).all()
    assert logits.std() > 0.5  # projections are wide enough that greedy choices are not near-ties
    out = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert out.shape[1] > ids.shape[1]


def test_second_call_reuses_cache(model_dir, monkeypatch):
    before = {p.name: p.stat().st_mtime_ns for p in model_dir.iterdir()}

    def no_rebuild(path):
        raise AssertionError("demo model rebuilt although it is cached")

    monkeypatch.setattr(demo, "_build_into", no_rebuild)
    assert ensure_demo_model(str(model_dir.parent)) == str(model_dir)
    assert {p.name: p.stat().st_mtime_ns for p in model_dir.iterdir()} == before


def test_deterministic_across_dirs_and_processes(model_dir, tmp_path):
    again = Path(ensure_demo_model(str(tmp_path / "again")))
    code = f"from banyan.demo import ensure_demo_model; print(ensure_demo_model({str(tmp_path / 'other')!r}))"
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONHASHSEED": "12345"}
    other = Path(subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True,
                                text=True).stdout.strip().splitlines()[-1])
    assert again.name == other.name == model_dir.name
    for name in DEMO_FILES:
        assert _sha256(again / name) == _sha256(model_dir / name) == _sha256(other / name), name


def test_race_loser_discards_its_copy(tmp_path, monkeypatch):
    """Another process finishes first while this one builds: both end up with the winner's dir."""
    real_build = demo._build_into
    raced = []

    def build_while_another_process_wins(path):
        if not raced:
            raced.append(True)
            ensure_demo_model(str(tmp_path))  # the "other process" builds and renames first
        real_build(path)

    monkeypatch.setattr(demo, "_build_into", build_while_another_process_wins)
    final = Path(ensure_demo_model(str(tmp_path)))
    assert raced and sorted(p.name for p in tmp_path.iterdir()) == [final.name]
    assert sorted(p.name for p in final.iterdir()) == sorted(DEMO_FILES)


def test_damaged_cache_is_rebuilt(tmp_path):
    final = Path(ensure_demo_model(str(tmp_path)))
    (final / "model.safetensors").unlink()
    assert ensure_demo_model(str(tmp_path)) == str(final)
    assert (final / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == [final.name]


def test_cache_root_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("BANYAN_CACHE_DIR", str(tmp_path / "banyan"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert demo_cache_root("/explicit") == Path("/explicit")
    assert demo_cache_root() == tmp_path / "banyan"
    monkeypatch.delenv("BANYAN_CACHE_DIR")
    assert demo_cache_root() == tmp_path / "xdg" / "banyan"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert demo_cache_root() == Path.home() / ".cache" / "banyan"
