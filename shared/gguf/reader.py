"""Opening a GGUF file: its metadata as plain Python values and its tensors, or a ``GGUFError``
that names the problem in one line."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gguf import GGUFReader, GGUFValueType, ReaderField, ReaderTensor

from shared.config import ConfigError


class GGUFError(ConfigError):
    """A GGUF file Banyan cannot serve: the message names the file and the problem in one line
    (a ``ConfigError``: the services report it as one line; ``banyan serve`` / ``convert`` exit 1)."""


@dataclass(frozen=True)
class GGUFFile:
    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, ReaderTensor]  # by GGUF name (blk.0.attn_q.weight …)

    @property
    def architecture(self) -> str:
        return str(self.require("general.architecture"))

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def require(self, key: str) -> Any:
        if key not in self.metadata:
            raise GGUFError(f"{self.path}: the metadata lacks {key!r}")
        return self.metadata[key]

    def arch(self, suffix: str, default: Any = ...) -> Any:
        """The architecture's own key (``llama.block_count`` for ``block_count``)."""
        key = f"{self.architecture}.{suffix}"
        return self.require(key) if default is ... else self.get(key, default)


def open_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """The file's metadata and tensors; ``GGUFError`` for a file that is missing, is no GGUF, or is
    cut short (a tensor whose bytes run past the end)."""
    path = Path(path)
    if not path.is_file():
        raise GGUFError(f"{path}: no such file")
    size = path.stat().st_size
    with path.open("rb") as fh:
        if fh.read(4) != b"GGUF":
            raise GGUFError(f"{path}: not a GGUF file (it does not start with the GGUF magic bytes)")
    try:
        reader = GGUFReader(path, "r")
    except (ValueError, IndexError, KeyError, OSError) as e:  # what the reader raises on bytes it cannot parse
        raise GGUFError(f"{path}: truncated or corrupt GGUF file ({size} bytes; the gguf reader: {e})") from None
    tensors: dict[str, ReaderTensor] = {}
    for t in reader.tensors:
        end = t.data_offset + t.n_bytes
        if end > size:
            raise GGUFError(f"{path}: truncated: tensor {t.name!r} ends at byte {end}, the file has {size}")
        tensors[t.name] = t
    metadata = {name: _value(field) for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    return GGUFFile(path, metadata, tensors)


def _value(field: ReaderField) -> Any:
    """A metadata field as str / int / float / bool, or a list of them."""
    if not field.types:
        return None
    if field.types[0] == GGUFValueType.ARRAY:
        kind = field.types[-1]
        items = [field.parts[i] for i in field.data]
        if kind == GGUFValueType.STRING:
            return [bytes(p).decode("utf-8", errors="replace") for p in items]
        return [_scalar(p, kind) for p in items]
    part = field.parts[field.data[0]]
    if field.types[0] == GGUFValueType.STRING:
        return bytes(part).decode("utf-8", errors="replace")
    return _scalar(part, field.types[0])


def _scalar(part: Any, kind: GGUFValueType) -> Any:
    value = part.tolist()[0] if hasattr(part, "tolist") else part
    if kind == GGUFValueType.BOOL:
        return bool(value)
    return value
