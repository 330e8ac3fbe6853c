"""The served model's tokenizer files as one zip, for ``GetTokenizer``: the gateway builds its
tokenizer (and chat template) from them and needs no copy of the model."""

from __future__ import annotations

import hashlib
import io
import zipfile
from pathlib import Path

CHUNK_BYTES = 64 * 1024  # per GetTokenizerChunk
FILES = ("tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json",
         "special_tokens_map.json", "vocab.json", "merges.txt", "tokenizer.model", "tiktoken.model",
         "chat_template.json", "chat_template.jinja", "added_tokens.json")
PATTERNS = ("*.tiktoken", "*.jinja")


def tokenizer_files(model_dir: str | Path) -> list[Path]:
    d = Path(model_dir)
    found = {p.name: p for p in (d / n for n in FILES) if p.is_file()}
    for pattern in PATTERNS:
        found.update({p.name: p for p in sorted(d.glob(pattern)) if p.is_file()})
    return [found[n] for n in sorted(found)]


def tokenizer_zip(model_dir: str | Path) -> tuple[bytes, str]:
    """The zip (files at its root, fixed timestamps: the same files give the same bytes) and its
    SHA-256 (hex)."""
    files = tokenizer_files(model_dir)
    if not files:
        raise FileNotFoundError(f"no tokenizer files in {model_dir}")
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for p in files:
            info = zipfile.ZipInfo(p.name, date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(info, p.read_bytes())
    data = buf.getvalue()
    return data, hashlib.sha256(data).hexdigest()


def chunks(data: bytes) -> list[bytes]:
    return [data[i:i + CHUNK_BYTES] for i in range(0, len(data), CHUNK_BYTES)] or [b""]
