"""GGUF checkpoints (llama.cpp's single-file format) turned into HF model directories.

A ``.gguf`` file is read with the ``gguf`` library (llama.cpp's own Python reader) and written out
once as an ordinary HF directory — config.json, generation_config.json, safetensors (every tensor
dequantized to one float dtype), tokenizer.json + tokenizer_config.json — which the services then
serve like any other model directory:

- reader.py     open a file: metadata as Python values, the tensors, one-line errors (``GGUFError``)
- tensors.py    the tensor types read (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K) → float arrays
- arch.py       architecture → HF config and tensor names; llama.cpp's Q/K row permutation undone
- tokenizer.py  the vocabulary, merges, special tokens and chat template → tokenizer files
- convert.py    ``convert`` (``banyan convert``) and ``converted_dir`` (``--model x.gguf``: a cache)
"""

from shared.gguf.reader import GGUFError

__all__ = ["GGUFError"]
