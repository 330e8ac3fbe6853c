"""GGUF files → HF directories (shared/gguf): every tensor type Banyan reads dequantizes to exactly
what transformers' own GGUF loader makes of it, llama.cpp's Q/K permutation undone; bad files are
refused by ``banyan serve`` / ``banyan convert`` in one line with exit code 1, before anything starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file

from shared.gguf.convert import convert
from tests.gguf.files import K_QUANTS, byte_level_tokenizer, hf_gguf_model, write_tiny
from tests.support import ROOT

TYPES = (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q5_K, Q.Q6_K)
# the largest |dequantized - original| each encoder may leave on weights of scale 0.05
TOLERANCE = {Q.F32: 0.0, Q.F16: 1e-4, Q.BF16: 1e-3, Q.Q8_0: 2e-3, Q.Q4_0: 4e-2, Q.Q4_1: 3e-2}


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_tensor_type_matches_transformers(qtype, tmp_path):
    path = tmp_path / f"tiny-{qtype.name}.gguf"
    made = write_tiny(path, qtype, seed=int(qtype))
    out = convert(path, tmp_path / "hf")
    ours = load_file(out / "model.safetensors")
    hf = hf_gguf_model(path)
    ref = hf.state_dict()
    assert set(ours) == set(ref)
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32 and tensor.shape == ref[name].shape, name
        assert torch.equal(tensor, ref[name]), f"{qtype.name}: {name} differs from transformers'"
    if qtype in K_QUANTS:  # random blocks: the values must still spread (a decoder that reads nothing would not)
        q = ours["model.layers.0.self_attn.q_proj.weight"]
        assert q.std() > 0 and len(q.unique()) > 64
    else:  # close to the weights the file was made from, in HF's row order (q/k unpermuted)
        for name, values in made.items():
            err = (ours[name] - torch.from_numpy(values)).abs().max().item()
            assert err <= TOLERANCE[qtype], f"{name}: {err}"
    config = json.loads((out / "config.json").read_text())
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "vocab_size", "max_position_embeddings", "tie_word_embeddings"):
        assert config[key] == getattr(hf.config, key), key
    assert config["rms_norm_eps"] == pytest.approx(hf.config.rms_norm_eps)


def test_bf16_output_and_qwen2_rows_kept(tmp_path):
    """--dtype bfloat16 stores bf16; a qwen2 file's q/k rows are not permuted (llama.cpp permutes llama only)."""
    path = tmp_path / "qwen2.gguf"
    made = write_tiny(path, Q.F32, arch="qwen2")
    out = convert(path, tmp_path / "hf", "bfloat16")
    ours = load_file(out / "model.safetensors")
    q = "model.layers.1.self_attn.q_proj.weight"
    assert ours[q].dtype == torch.bfloat16
    assert torch.equal(ours[q], torch.from_numpy(made[q]).to(torch.bfloat16))
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]


def _bad_files(tmp_path):
    good = tmp_path / "good.gguf"
    write_tiny(good, Q.Q8_0)
    data = good.read_bytes()
    (tmp_path / "truncated.gguf").write_bytes(data[: len(data) * 2 // 3])
    write_tiny(tmp_path / "mamba.gguf", Q.F32, arch="mamba")
    write_tiny(tmp_path / "q5_0.gguf", Q.Q5_0)
    (tmp_path / "text.gguf").write_bytes(b"this is not a model\n" * 4)
    write_tiny(tmp_path / "split.gguf", Q.F32, tokenizer=lambda w: (w.add_uint16("split.count", 3),
                                                                   byte_level_tokenizer(w))[1])
    return {"truncated.gguf": "truncated", "mamba.gguf": "architecture 'mamba' is not supported",
            "q5_0.gguf": "has type Q5_0, which Banyan does not dequantize", "text.gguf": "not a GGUF file",
            "split.gguf": "one part of a split GGUF (3 parts)"}


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "banyan.cli", *args], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=120)


def test_bad_files_refused_in_one_line(tmp_path, cache_dir):
    for name, problem in _bad_files(tmp_path).items():
        path = tmp_path / name
        served = _run("serve", "--model", str(path), "--grpc-port", "0", "--http-port", "-1")
        assert served.returncode == 1, served.stderr[-2000:]
        errors = [line for line in served.stderr.splitlines() if "error" in line]
        assert len(errors) == 1 and problem in errors[0] and str(path) in errors[0], served.stderr[-2000:]
        assert "Traceback" not in served.stderr and '"started"' not in served.stderr  # nothing started
    converted = _run("convert", str(tmp_path / "mamba.gguf"), str(tmp_path / "out"))
    assert converted.returncode == 1 and "architecture 'mamba' is not supported" in converted.stderr
    assert "Traceback" not in converted.stderr and not (tmp_path / "out" / "config.json").exists()
    left = [p.name for p in (cache_dir / "gguf").glob("*") if p.name.lstrip(".").split(".")[0].split("-")[0]
            in {"truncated", "mamba", "q5_0", "text", "split"}]
    assert not left  # a refused file leaves nothing in the cache, not even a half-written directory


def test_served_gguf_converted_once_then_reused(tmp_path):
    from shared.gguf.convert import converted_dir

    path = tmp_path / "tiny.gguf"
    write_tiny(path, Q.Q8_0)
    first = converted_dir(path, "float32", tmp_path / "cache")
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert converted_dir(path, "float32", tmp_path / "cache") == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp  # not written again
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [first.name]  # no temporary directory left
    other = converted_dir(path, "bfloat16", tmp_path / "cache")  # another dtype: its own directory
    assert other != first and load_file(other / "model.safetensors")["model.norm.weight"].dtype == torch.bfloat16
    os.utime(path, ns=(stamp, stamp + 10**9))  # the file changed: converted again
    assert converted_dir(path, "float32", tmp_path / "cache") != first


TEXTS = ["the cat", "  the  cat sat\n\nthe end", "thé çat 🙂 42", "<s>the</s> cat", "<|im_start|>user\nthe<|im_end|>",
         "", " ", "hehehe the"]


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_tokenizer_matches_transformers(kind, tmp_path):
    """Both tokenizer models GGUF files carry, as transformers builds them from the same metadata:
    ids with and without special tokens, and the decoded text."""
    from transformers import AutoTokenizer

    from tests.gguf.files import sentencepiece_tokenizer

    path = tmp_path / f"{kind}.gguf"
    write_tiny(path, Q.F32, tokenizer=byte_level_tokenizer if kind == "gpt2" else sentencepiece_tokenizer)
    ref = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    ours = AutoTokenizer.from_pretrained(convert(path, tmp_path / "hf"))
    for text in TEXTS:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == ref.encode(text, add_special_tokens=special), (kind, text, special)
            assert ours.decode(ids) == ref.decode(ids), (kind, text)
    assert (ours.encode("the cat")[0] == 1) == (kind == "llama")  # BOS by default for SentencePiece only
