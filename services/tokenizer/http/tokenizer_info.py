"""``GET /tokenizer_info`` in vLLM's shape: the tokenizer's class, its configuration
(``tokenizer_config.json``'s settings: special tokens, ``model_max_length`` …) and the chat template,
so a client (lm-eval's remote tokenizer) can tokenize with ``/tokenize`` and render chats itself."""

from __future__ import annotations

from typing import Any

from services.tokenizer.text import TextProcessor

_SKIP = frozenset({"name_or_path", "tokenizer_file", "vocab_file", "merges_file"})  # paths on the server


def _plain(value: Any) -> Any:
    """JSON-able: special tokens (``AddedToken``) by their text; other objects by their ``str``."""
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [_plain(v) for v in value]
    content = getattr(value, "content", None)
    return content if isinstance(content, str) else str(value)


def tokenizer_info(text: TextProcessor) -> dict[str, Any]:
    tok = text.tokenizer
    info: dict[str, Any] = {"tokenizer_class": type(tok).__name__}
    info.update({k: _plain(v) for k, v in (getattr(tok, "init_kwargs", None) or {}).items()
                 if k not in _SKIP and not k.startswith("_")})
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):  # as the tokenizer resolved them
        value = getattr(tok, name, None)
        if value is not None:
            info[name] = _plain(value)
    if isinstance(getattr(tok, "chat_template", None), str):
        info["chat_template"] = tok.chat_template
    info["model_max_length"] = _plain(getattr(tok, "model_max_length", info.get("model_max_length")))
    return info
