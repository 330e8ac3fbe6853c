"""The tokenizer a GGUF file describes (``tokenizer.ggml.*`` and ``tokenizer.chat_template``) as HF
tokenizer files, read the way transformers reads a GGUF: byte-level BPE over the file's vocabulary
and merges (the split regex chosen by ``tokenizer.ggml.pre``), or SentencePiece BPE (merges ranked
from the scores when the file has none); tokens marked control added whole as special tokens,
user-defined ones whole as plain tokens; BOS prepended when the file says ``add_bos_token``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from shared.gguf.reader import GGUFError, GGUFFile

CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types

# How each pre-tokenizer named in tokenizer.ggml.pre splits text before BPE (others: GPT-2's split).
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
SPLITS = {"llama3": _LLAMA3, "llama-v3": _LLAMA3, "llama-bpe": _LLAMA3, "smaug-bpe": _LLAMA3, "dbrx": _LLAMA3,
          "qwen2": _QWEN2, "deepseek-r1-qwen": _QWEN2}


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte (the alphabet byte-level BPE vocabularies are spelled in)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    spelling, extra = {b: chr(b) for b in kept}, 0
    for b in range(256):
        if b not in spelling:
            spelling[b], extra = chr(256 + extra), extra + 1
    return spelling


def build_tokenizer(f: GGUFFile) -> Tokenizer:
    """The HF tokenizer of the file: byte-level BPE (``gpt2``) or SentencePiece BPE (``llama``)."""
    kind = f.get("tokenizer.ggml.model")
    if kind not in ("gpt2", "llama"):
        raise GGUFError(f"{f.path}: tokenizer model {kind!r} is not supported (byte-level BPE 'gpt2' or "
                        f"SentencePiece BPE 'llama')")
    tokens: list[str] = f.require("tokenizer.ggml.tokens")
    types: list[int] = f.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    tok, spelled = _byte_level(f, tokens) if kind == "gpt2" else _sentencepiece(f, tokens)
    # a token marked control but spelled outside the byte alphabet is a mislabel: adding it would grow the vocabulary
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True)
                            for t, k in zip(tokens, types) if k == CONTROL and spelled(t)])
    vocab = tok.get_vocab()
    tok.add_tokens([AddedToken(t, normalized=False, special=False)
                    for t, k in zip(tokens, types) if k == USER_DEFINED and t in vocab])
    steps: list[Any] = [processors.ByteLevel(trim_offsets=False)] if kind == "gpt2" else []
    bos = _token(f, tokens, "bos")
    # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise
    if f.get("tokenizer.ggml.add_bos_token", kind == "llama") and bos is not None:
        bos_id = int(f.get("tokenizer.ggml.bos_token_id"))
        steps.append(processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                   special_tokens=[(bos, bos_id)]))
    tok.post_processor = processors.Sequence(steps)
    return tok


def _byte_level(f: GGUFFile, tokens: list[str]) -> tuple[Tokenizer, Callable[[str], bool]]:
    spell = _byte_alphabet()
    alphabet = set(spell.values())
    vocab = {(t if set(t) <= alphabet else "".join(spell[b] for b in t.encode())): i for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in f.require("tokenizer.ggml.merges")]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    split = SPLITS.get(f.get("tokenizer.ggml.pre", ""))
    tok.pre_tokenizer = (pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True) if split is None else
                         pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                  pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]))
    tok.decoder = decoders.ByteLevel()
    return tok, lambda t: set(t) <= alphabet


def _sentencepiece(f: GGUFFile, tokens: list[str]) -> tuple[Tokenizer, Callable[[str], bool]]:
    """BPE over ``▁``-marked pieces with byte fallback (``<0x0A>`` …), a ``▁`` before the first word."""
    vocab = {t: i for i, t in enumerate(tokens)}
    if "tokenizer.ggml.merges" in f.metadata:
        merges = [tuple(m.split(" ", 1)) for m in f.metadata["tokenizer.ggml.merges"]]
    else:
        merges = _merges_from_scores(tokens, f.require("tokenizer.ggml.scores"))
    unk = _token(f, tokens, "unknown")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(content=" ", left=1)])
    return tok, lambda t: True


def _merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """The merges a SentencePiece vocabulary implies: every split of a piece into two pieces of the
    vocabulary, ranked by the whole piece's score (best first; ties: longer left, then right piece)."""
    index = {t: i for i, t in enumerate(tokens)}
    found: list[tuple[float, int, int, int, str, str]] = []
    for piece, score in zip(tokens, scores):
        splits = [(piece[:k], piece[k:]) for k in range(1, len(piece)) if piece[:k] in index and piece[k:] in index]
        for left, right in sorted(splits, key=lambda lr: (index[lr[0]], index[lr[1]])):
            found.append((score, len(left), len(right), len(found), left, right))
    found.sort(key=lambda m: (-m[0], -m[1], -m[2], m[3]))
    return [(m[4], m[5]) for m in found]


def _token(f: GGUFFile, tokens: list[str], key: str) -> str | None:
    token_id = f.get(f"tokenizer.ggml.{key}_token_id")
    if token_id is None:
        return None
    if not 0 <= int(token_id) < len(tokens):
        raise GGUFError(f"{f.path}: tokenizer.ggml.{key}_token_id {token_id} is outside the vocabulary")
    return tokens[int(token_id)]


def stop_token_ids(f: GGUFFile) -> list[int]:
    """EOS, then the end-of-turn / end-of-message tokens the file names (generation_config.json)."""
    ids = [f.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    return list(dict.fromkeys(int(i) for i in ids if i is not None))


def write_tokenizer(f: GGUFFile, tokenizer: Tokenizer, out: Path) -> None:
    """tokenizer.json (``tokenizer``, built by ``build_tokenizer``) and tokenizer_config.json (with
    the chat template) into ``out``."""
    tokenizer.save(str(out / "tokenizer.json"))
    tokens = f.require("tokenizer.ggml.tokens")
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
                              "model_max_length": int(f.arch("context_length", 0)) or 1 << 30,
                              "add_bos_token": bool(f.get("tokenizer.ggml.add_bos_token", False)),
                              "add_eos_token": bool(f.get("tokenizer.ggml.add_eos_token", False))}
    for name, key in (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"), ("pad_token", "padding")):
        if (token := _token(f, tokens, key)) is not None:
            config[name] = token
    if template := f.get("tokenizer.chat_template"):
        config["chat_template"] = template
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
