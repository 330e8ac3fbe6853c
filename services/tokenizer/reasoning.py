"""Reasoning output (``--reasoning-parser``): the thinking part of a choice's text, ``<think>`` …
``</think>``, split from its answer, incrementally (any split of a text gives the same two parts).

- ``qwen3``: thinking only when the output starts with ``<think>`` or the prompt ends with one
  (the template opened it); a Qwen3 prompt with ``enable_thinking: false`` has an empty block.
- ``deepseek_r1``: the output is thinking up to ``</think>`` (R1's template opens the block; a
  ``<think>`` the model repeats is dropped); all of it when the tag never comes.

Whitespace between ``</think>`` and the answer is dropped.
"""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"
REASONING_PARSERS = ("qwen3", "deepseek_r1")


def _held(text: str, marker: str) -> int:
    return next((k for k in range(min(len(marker) - 1, len(text)), 0, -1) if text.endswith(marker[:k])), 0)


class ReasoningParser:
    """One choice's split: ``feed`` → (reasoning, content) pieces."""

    def __init__(self, style: str, prompt_tail: str = "") -> None:
        if style not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {style!r} (one of {', '.join(REASONING_PARSERS)})")
        opened = prompt_tail.rstrip().endswith(OPEN)
        # start: the beginning (an OPEN may come) | think | answer_ws (before the answer) | answer
        self._state = "think" if opened else "start"
        self._always = style == "deepseek_r1"
        self._buf = ""

    def feed(self, text: str) -> tuple[str, str]:
        s, self._buf = self._buf + text, ""
        reasoning, content = [], []
        while s:
            if self._state == "start":
                t = s.lstrip()
                if OPEN.startswith(t) and t != OPEN:
                    self._buf = s
                    break
                if t.startswith(OPEN):
                    s, self._state = t[len(OPEN):], "think"
                else:
                    self._state = "think" if self._always else "answer"
            elif self._state == "think":
                at = s.find(CLOSE)
                if at >= 0:
                    reasoning.append(s[:at])
                    s, self._state = s[at + len(CLOSE):], "answer_ws"
                    continue
                k = _held(s, CLOSE)
                reasoning.append(s[:len(s) - k])
                self._buf = s[len(s) - k:]
                break
            elif self._state == "answer_ws":
                s = s.lstrip()
                if s:
                    self._state = "answer"
            else:
                content.append(s)
                break
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """What was held back: the start of a tag that never completed."""
        s, self._buf = self._buf, ""
        if self._state == "think" or (self._state == "start" and self._always):
            return s, ""
        return "", s if self._state in ("start", "answer") else ""
