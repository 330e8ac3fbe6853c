"""The tokenizer side of text: loading the HF tokenizer, chat templates, tokenize, decode."""

from __future__ import annotations

from dataclasses import dataclass

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from shared.errors import InvalidArgument


@dataclass(frozen=True)
class Message:
    role: str
    content: str
    tool_calls: tuple[dict, ...] = ()  # an assistant turn's calls: {id, type, function: {name, arguments}}
    tool_call_id: str = ""  # a tool turn: the call it answers
    reasoning_content: str = ""

    def for_template(self) -> dict:
        """The message as chat templates read it (only the fields it has)."""
        m: dict = {"role": self.role, "content": self.content}
        if self.tool_calls:
            m["tool_calls"] = list(self.tool_calls)
        if self.tool_call_id:
            m["tool_call_id"] = self.tool_call_id
        if self.reasoning_content:
            m["reasoning_content"] = self.reasoning_content
        return m


@dataclass(frozen=True)
class ChatExtras:
    """What a chat prompt gives the template besides its messages: the tools (OpenAI's
    ``{type: function, function: {...}}`` dicts) and ``chat_template_kwargs``."""

    tools: tuple[dict, ...] = ()
    kwargs: tuple[tuple[str, object], ...] = ()


class TextProcessor:
    def __init__(self, model_dir: str) -> None:
        self.tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(model_dir)
        self.has_chat_template = bool(getattr(self.tokenizer, "chat_template", None))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def render_chat(self, messages: list[Message], add_generation_prompt: bool = True,
                    extras: ChatExtras | None = None) -> str:
        if not self.has_chat_template:
            raise InvalidArgument("this model has no chat template: send text or token_ids")
        extras = extras or ChatExtras()
        try:
            return self.tokenizer.apply_chat_template(
                [m.for_template() for m in messages], tools=list(extras.tools) or None,
                add_generation_prompt=add_generation_prompt, tokenize=False, **dict(extras.kwargs))
        except Exception as e:  # template errors (jinja raise_exception, bad roles) are the caller's input
            raise InvalidArgument(f"chat template failed: {e}") from e

    def render_chat_continuation(self, messages: list[Message], add_generation_prompt: bool = True,
                                 extras: ChatExtras | None = None) -> str:
        """``messages`` rendered as the continuation of a conversation under way (a session's next
        turn): the template applied to them once, without what it puts at the start of a
        conversation (BOS, a default system prompt). It is what rendering [m0, *messages] adds to
        rendering [m0] for a placeholder first message m0 (a system, user or assistant one: the
        first the template renders as a prefix)."""
        for role in ("system", "user", "assistant"):
            head_msg = [Message(role, "")]
            try:
                head = self.render_chat(head_msg, False, extras)
                full = self.render_chat(head_msg + list(messages), add_generation_prompt, extras)
            except InvalidArgument:
                continue
            if full.startswith(head):
                return full[len(head):]
        raise InvalidArgument("the model's chat template cannot render these messages as the continuation of a "
                              "conversation: send text or token ids in this session")

    def encode_chat(self, messages: list[Message], add_generation_prompt: bool = True,
                    extras: ChatExtras | None = None) -> list[int]:
        # The rendered template carries its own special tokens (BOS, role headers).
        return self.encode(self.render_chat(messages, add_generation_prompt, extras), add_special_tokens=False)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def tokens(self, ids: list[int]) -> list[str]:
        return list(self.tokenizer.convert_ids_to_tokens(ids))
