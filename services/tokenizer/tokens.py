"""Tokenize and detokenize for the fronts' utility calls (gRPC ``Tokenize`` / ``Detokenize``,
HTTP ``/tokenize`` / ``/detokenize``). Generation prompts go through ``validation.prepare``."""

from __future__ import annotations

from shared.errors import InvalidArgument
from shared.messages.to_tokenizer import ModelInfo
from services.tokenizer.text import TextProcessor
from services.tokenizer.validation import Prompt, check_chat_size, check_messages, check_text_size

MAX_DETOKENIZE_IDS = 1 << 20


def tokenize(text: TextProcessor, prompt: Prompt, info: ModelInfo, add_special_tokens: bool = True) -> list[int]:
    """Token ids of a text (``add_special_tokens``: BOS etc.) or of rendered chat messages. Text
    longer than any prompt of the model can be is refused (``validation.max_text_chars``)."""
    if prompt.text is not None:
        check_text_size(len(prompt.text), info, "the text")
        return text.encode(prompt.text, add_special_tokens=add_special_tokens)
    if prompt.messages is not None:
        check_messages(prompt.messages)
        check_chat_size(prompt.messages, info)
        return text.encode_chat(prompt.messages, prompt.add_generation_prompt, prompt.extras)
    raise InvalidArgument("a text or chat messages to tokenize are required")


def detokenize(text: TextProcessor, ids: list[int], skip_special_tokens: bool = True, name: str = "token_ids") -> str:
    if len(ids) > MAX_DETOKENIZE_IDS:
        raise InvalidArgument(f"{name}: {len(ids)} token ids, at most {MAX_DETOKENIZE_IDS} are decoded at once")
    vocab = len(text.tokenizer)
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise InvalidArgument(f"{name}: {bad} is out of the vocabulary [0, {vocab})")
    return text.decode(ids, skip_special_tokens=skip_special_tokens)
