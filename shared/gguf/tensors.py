"""The GGUF tensor types Banyan reads, dequantized with the gguf library's own block decoders."""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import ReaderTensor
from gguf.quants import dequantize

from shared.gguf.reader import GGUFError, GGUFFile

SUPPORTED = (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q5_K, Q.Q6_K)
_PLAIN = (Q.F32, Q.F16)  # stored as numpy floats already


def check_types(f: GGUFFile) -> None:
    """``GGUFError`` naming the first tensor of a type not in ``SUPPORTED``."""
    for name, t in f.tensors.items():
        if t.tensor_type not in SUPPORTED:
            names = ", ".join(q.name for q in SUPPORTED)
            raise GGUFError(f"{f.path}: tensor {name!r} has type {t.tensor_type.name}, which Banyan does not "
                            f"dequantize (supported: {names})")


def to_float32(t: ReaderTensor) -> np.ndarray:
    """The tensor as float32 in row-major (PyTorch) order: GGUF lists dimensions fastest first, so a
    linear layer's (in, out) there is (out, in) here."""
    data = np.asarray(t.data)
    values = data.astype(np.float32) if t.tensor_type in _PLAIN else dequantize(data, t.tensor_type)
    return values.reshape(tuple(int(n) for n in reversed(t.shape)))
