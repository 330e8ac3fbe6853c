"""A GGUF file written out as an HF model directory: ``convert`` (``banyan convert``) and
``converted_dir`` (``--model x.gguf``: converted once into Banyan's cache, then reused)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from tokenizers import Tokenizer

from shared.gguf.arch import arch_of, hf_config, hf_name, unpermute
from shared.gguf.reader import GGUFError, GGUFFile, open_gguf
from shared.gguf.tensors import check_types, to_float32
from shared.gguf.tokenizer import build_tokenizer, stop_token_ids, write_tokenizer

DTYPES = ("float32", "bfloat16", "float16")
SHARD_BYTES = 4 << 30  # safetensors files of at most about this size
FORMAT = 1  # bump when the directory written for the same file changes (a new cache key)


def check(f: GGUFFile) -> Tokenizer:
    """Everything ``convert`` refuses, before anything is written: architecture, tensor types and
    names, the tokenizer (returned)."""
    if int(f.get("split.count", 1)) > 1:
        raise GGUFError(f"{f.path}: one part of a split GGUF ({f.get('split.count')} parts); join them first "
                        f"(llama.cpp's llama-gguf-split --merge)")
    arch_of(f)
    check_types(f)
    for name in f.tensors:
        hf_name(f, name)
    hf_config(f, "float32")
    return build_tokenizer(f)


def convert(gguf_path: str | os.PathLike[str], out_dir: str | os.PathLike[str], dtype: str = "float32") -> Path:
    """Write the HF directory of ``gguf_path`` into ``out_dir`` (created; files in it replaced):
    config.json, generation_config.json, model*.safetensors, tokenizer files. Every tensor is
    dequantized to float32 and stored as ``dtype``. ``GGUFError`` for a file Banyan cannot serve."""
    import torch
    from safetensors.torch import save_file

    if dtype not in DTYPES:
        raise GGUFError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    f = open_gguf(gguf_path)
    tokenizer = check(f)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in f.tensors.items():
        tensor = torch.from_numpy(unpermute(f, name, to_float32(t))).to(getattr(torch, dtype)).contiguous()
        if size and size + tensor.nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][hf_name(f, name)] = tensor
        size += tensor.nbytes
    files = ["model.safetensors"] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for file, shard in zip(files, shards):
        save_file(shard, str(out / file), metadata={"format": "pt"})
    if len(shards) > 1:
        index = {"metadata": {}, "weight_map": {n: file for file, s in zip(files, shards) for n in s}}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    _write_json(out / "config.json", hf_config(f, dtype))
    generation = {"bos_token_id": f.get("tokenizer.ggml.bos_token_id"), "eos_token_id": stop_token_ids(f)}
    _write_json(out / "generation_config.json", {k: v for k, v in generation.items() if v not in (None, [])})
    write_tokenizer(f, tokenizer, out)
    return out


def weights_dtype(dtype: str) -> str:
    """The dtype a GGUF's cached directory is written in for ``--dtype``: auto is bfloat16 where CUDA
    is, else float32 (what the worker computes in)."""
    if dtype != "auto":
        return dtype
    import torch

    return "bfloat16" if torch.cuda.is_available() else "float32"


def cache_key(gguf_path: Path) -> str:
    """What identifies a file's conversion: its size, modification time and first MiB."""
    st = gguf_path.stat()
    h = hashlib.sha256(f"{FORMAT}:{st.st_size}:{st.st_mtime_ns}:".encode())
    with gguf_path.open("rb") as fh:
        h.update(fh.read(1 << 20))
    return h.hexdigest()[:16]


def converted_dir(gguf_path: str | os.PathLike[str], dtype: str, cache: Path) -> Path:
    """The HF directory of ``gguf_path`` with ``dtype`` weights under ``cache``, converted on first
    use (into a temporary directory renamed into place: a conversion cut short leaves nothing)."""
    path = Path(gguf_path)
    if not path.is_file():
        raise GGUFError(f"{path}: no such file")
    target = cache / f"{path.stem}-{cache_key(path)}-{dtype}"
    if (target / "config.json").is_file():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=cache))
    try:
        convert(path, work, dtype)
        try:
            work.rename(target)
        except OSError:  # another process finished the same conversion first
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n")
