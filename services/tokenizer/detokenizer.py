"""Incremental detokenization with stop strings, for streaming one request's output.

Token ids arrive in chunks; :meth:`IncrementalDetokenizer.push` returns the text that became final,
:meth:`IncrementalDetokenizer.finish` flushes the rest. Concatenated, the pieces equal
``tokenizer.decode(output_ids, skip_special_tokens=...)`` (no clean-up of tokenization spaces),
unless a stop string cuts the text short.

Window decoding (the prefix/read offset technique of vLLM and TGI): only a few ids are decoded per
push — ``ids[prefix:]``, where ``ids[prefix:read]`` is already-returned context whose text is
``prefix_text`` — and the new text is what the window decodes to beyond ``prefix_text``. Context
matters for decoders that treat the first token specially (SentencePiece strips its leading space);
the first window starts inside the prompt so the first output token keeps its space (unless the
prompt ends inside a character, which the output must not complete: it decodes on its own).

Partial characters: byte-level tokens can end in the middle of a UTF-8 character, which decodes to
U+FFFD until its remaining bytes arrive. Lossy UTF-8 decoding only ever changes the *last* character
when bytes are appended, so a cut point ``j`` is final once the window decoded to ``j`` is a strict
prefix of the window decoded to the end: the character at the cut has been completed or terminated.
When the window ends in U+FFFD, the longest such cut within the last few ids is returned and the
rest held back. Genuinely invalid bytes therefore do not stall the stream either.

Stop strings: the earliest *completed* stop string (ties: the one starting first) truncates the
output before it; nothing from it or after it is returned. The longest suffix of the text that is a
proper prefix of some stop string is held back (at most ``len(longest stop) - 1`` characters) so no
part of a stop string is ever streamed; ``finish()`` releases it when no stop matched.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Sequence

__all__ = ["IncrementalDetokenizer"]

_FFFD = "\ufffd"
_CONTEXT = 5  # prompt ids (and at most this many returned ids) decoded ahead of the new ids
_MAX_BACKOFF = 8  # cut points tried when the window ends in U+FFFD (a character is ≤ 4 bytes)
_MAX_PENDING = 32  # held ids before giving up on completion (only reachable with empty-text ids)

_skip_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class IncrementalDetokenizer:
    """Streams the text of one request's generated ids. Not thread-safe; one per request.

    Args:
        tokenizer: a HF tokenizer (``PreTrainedTokenizerFast`` or anything with ``decode``).
        prompt_ids: the prompt's ids; only the last few are used, as decoding context.
        skip_special_tokens: drop special tokens from the text (as ``decode`` does).
        stop: stop strings (non-empty; a lone ``str`` is one stop string); matching rules are in the
            module docstring.

    Attributes:
        stopped: a stop string matched; further ids are ignored.
        matched_stop: the stop string that matched, else ``None``.
    """

    def __init__(
        self,
        tokenizer,
        prompt_ids: Sequence[int],
        skip_special_tokens: bool = True,
        stop: Iterable[str] = (),
    ) -> None:
        self._decode, skippable = _decoder_for(tokenizer, skip_special_tokens)
        # Skipped special ids decode to nothing, so they are dropped up front: a long run of them
        # then cannot grow the window, and the window's context is always real text.
        self._skip_ids: frozenset[int] = skippable if skip_special_tokens else frozenset()
        self._ids: list[int] = _tail(prompt_ids, _CONTEXT, self._skip_ids)  # the window; prefix = 0
        self._prefix_text = self._decode(self._ids)
        if self._prefix_text.endswith(_FFFD):
            # The prompt may end inside a character; the output's first bytes must not complete it
            # (the output alone decodes them as U+FFFD), so start without context.
            self._ids, self._prefix_text = [], ""
        self._read = len(self._ids)

        stops = [stop] if isinstance(stop, str) else list(dict.fromkeys(stop))  # dedupe, keep order
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        self._stops = stops
        self._stop_prefixes = frozenset(s[:i] for s in stops for i in range(1, len(s)))
        self._max_held = max((len(s) - 1 for s in stops), default=0)
        self._held = ""  # text withheld because it may begin a stop string

        self._pieces: list[str] = []
        self._finished = False
        self.stopped = False
        self.matched_stop: str | None = None

    @property
    def text(self) -> str:
        """All text returned so far by :meth:`push` and :meth:`finish`."""
        return "".join(self._pieces)

    def push(self, token_ids: Sequence[int]) -> str:
        """Add generated ids; return the text that became final since the last call (maybe "")."""
        if self._finished:
            raise RuntimeError("push() after finish()")
        if self.stopped:
            return ""
        skip = self._skip_ids
        if skip:
            self._ids.extend(t for t in token_ids if t not in skip)
        else:
            self._ids.extend(token_ids)
        return self._emit(self._advance(flush=False))

    def finish(self) -> str:
        """End of generation: return all remaining text, incomplete characters (U+FFFD) included.

        Returns "" if a stop string matched. Idempotent.
        """
        if self._finished:
            return ""
        self._finished = True
        if self.stopped:
            return ""
        out = self._emit(self._advance(flush=True))
        if not self.stopped and self._held:
            out += self._held
            self._pieces.append(self._held)
            self._held = ""
        return out

    # -- window decoding ------------------------------------------------------------------------

    def _advance(self, flush: bool) -> str:
        """Decode the window; return its final new text and slide the window past it."""
        ids, read = self._ids, self._read
        n = len(ids)
        if n == read:
            return ""
        end, text = n, self._decode(ids)
        if text.endswith(_FFFD) and not flush and n - read <= _MAX_PENDING:
            end, text = self._last_final_cut(text)
            if end == read:
                return ""
        new = text[len(self._prefix_text):]
        # Slide: the returned ids become the next context (at most _CONTEXT of them).
        start = max(read, end - _CONTEXT)
        del ids[:start]
        self._read = end - start
        self._prefix_text = self._decode(ids[: self._read])
        return new

    def _last_final_cut(self, full: str) -> tuple[int, str]:
        """Largest cut ``j`` (read < j < n) whose decoded text is final w.r.t. ``full``.

        Returns ``(read, "")`` when there is none (the ids after ``read`` are one incomplete char).
        """
        ids, read = self._ids, self._read
        n = len(ids)
        for j in range(n - 1, max(read, n - _MAX_BACKOFF), -1):
            text = self._decode(ids[:j])
            if len(text) < len(full) and full.startswith(text):
                return j, text
        return read, ""

    # -- stop strings ---------------------------------------------------------------------------

    def _emit(self, new_text: str) -> str:
        """Apply stop strings to newly final text; record and return what may be streamed."""
        if not new_text or self.stopped:
            return ""
        buf = self._held + new_text  # a stop cannot start earlier: that text was never held back
        hit = self._find_stop(buf)
        if hit is not None:
            cut, self.matched_stop = hit
            self.stopped = True
            out, self._held = buf[:cut], ""
        else:
            keep = self._held_len(buf)
            out, self._held = buf[: len(buf) - keep], buf[len(buf) - keep :]
        if out:
            self._pieces.append(out)
        return out

    def _find_stop(self, buf: str) -> tuple[int, str] | None:
        """(start, stop) of the stop string that completes first in ``buf``; ties: starts first."""
        best: tuple[int, int, str] | None = None
        for s in self._stops:
            i = buf.find(s)
            if i >= 0 and (best is None or (i + len(s), i) < best[:2]):
                best = (i + len(s), i, s)
        return None if best is None else (best[1], best[2])

    def _held_len(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that is a proper prefix of a stop string."""
        for k in range(min(len(buf), self._max_held), 0, -1):
            if buf[-k:] in self._stop_prefixes:
                return k
        return 0


def _tail(ids: Sequence[int], count: int, skip: frozenset[int]) -> list[int]:
    """The last ``count`` ids not in ``skip``, in order."""
    out: list[int] = []
    for t in reversed(ids):
        if len(out) == count:
            break
        if t not in skip:
            out.append(t)
    out.reverse()
    return out


def _decoder_for(tokenizer, skip_special_tokens: bool) -> tuple[Callable[[list[int]], str], frozenset[int]]:
    """A ``ids -> text`` function for ``tokenizer`` and the ids it drops when skipping specials.

    Fast tokenizers decode through their Rust backend directly (same result as
    ``tokenizer.decode`` without clean-up, a few times cheaper); the skipped ids are then exactly the
    backend's special added tokens. Other tokenizers use ``decode`` and drop nothing up front.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        def decode(ids: list[int]) -> str:
            return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)

        return decode, frozenset()

    def decode_fast(ids: list[int]) -> str:
        return backend.decode(ids, skip_special_tokens=skip_special_tokens)

    skippable = _skip_cache.get(backend)
    if skippable is None:  # computed once per tokenizer (its added tokens are fixed while serving)
        skippable = frozenset(i for i, tok in backend.get_added_tokens_decoder().items() if tok.special)
        _skip_cache[backend] = skippable
    return decode_fast, skippable
