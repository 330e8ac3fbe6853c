"""Generation ``Chunk``s → SGLang's ``/generate`` outputs: ``{"text", "output_ids", "meta_info"}``
per prompt and branch (prompt ``i``'s branch ``j`` is output ``i·n + j``), ``meta_info`` with
``id``, ``finish_reason`` (``{"type": "stop", "matched": str | token id}``, ``{"type": "length",
"length": max_new_tokens}`` or ``{"type": "abort", ...}``), token counts, ``e2e_latency`` and, with
``return_logprob``, the log-probs as ``[logprob, token_id, text | None]`` entries."""

from __future__ import annotations

import math
import time

from shared.messages.common import FinishReason
from services.tokenizer.generation import Chunk, TokenLogprob
from services.tokenizer.http.convert import TokenTexts
from services.tokenizer.http.native.convert import Item
from services.tokenizer.validation import Prepared

WEIGHT_VERSION = "default"


class Output:
    """One output (prompt, branch), gathered from its chunks. ``prompt_logprobs`` is shared by the
    branches of one prompt (the engine sends it once, with branch 0)."""

    def __init__(self, item: Item, p: Prepared, rid: str, texts: TokenTexts, with_text: bool,
                 prompt_logprobs: list) -> None:
        self.item, self.p, self.rid, self.texts, self.with_text = item, p, rid, texts, with_text
        self.parts: list[str] = []
        self.ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.prompt_logprobs = prompt_logprobs  # [list[TokenLogprob]] once it came
        self.last: Chunk | None = None

    def add(self, c: Chunk) -> None:
        self.parts.append(c.text)
        self.ids.extend(c.token_ids)
        self.logprobs.extend(c.logprobs or ())
        if c.prompt_logprobs is not None and not self.prompt_logprobs:
            self.prompt_logprobs.append(c.prompt_logprobs)
        if c.finish:
            self.last = c

    def _entry(self, logprob: float | None, token_id: int) -> list:
        if logprob is not None and not math.isfinite(logprob):  # (JSON has no -inf: null, as orjson writes it)
            logprob = None
        return [logprob, token_id, self.texts(token_id) if self.with_text else None]

    def finish_reason(self) -> dict | None:
        c = self.last
        if c is None:
            return None
        if c.finish is FinishReason.STOP:
            return {"type": "stop", "matched": c.matched_stop or c.matched_stop_token_id}
        if c.finish is FinishReason.LENGTH:
            return {"type": "length", "length": self.item.max_new_tokens}
        return {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}

    def _input(self) -> tuple[list, list]:
        """SGLang's input log-probs: an entry per prompt position from ``logprob_start_len`` on; the
        first one's log-prob is None (the engine was asked from the position after it)."""
        start, ids = self.item.logprob_start, self.p.req.input_ids
        if start < 0 or start >= len(ids):
            return [], []
        engine = self.prompt_logprobs[0] if self.prompt_logprobs else []
        tokens, tops = [self._entry(None, ids[start])], [None]
        for pos in range(start + 1, len(ids)):
            k = pos - start - 1
            t = engine[k] if k < len(engine) else None
            tokens.append(self._entry(t.logprob if t is not None else None, ids[pos]))
            tops.append([self._entry(lp, i) for i, lp in t.top] if t is not None else None)
        return tokens, tops

    def meta(self, received: float) -> dict:
        u = self.last.usage if self.last is not None else None
        meta = {"id": self.rid, "finish_reason": self.finish_reason(),
                "prompt_tokens": u.prompt_tokens if u else self.p.prompt_tokens,
                "completion_tokens": len(self.ids), "cached_tokens": u.cached_tokens if u else 0,
                "weight_version": WEIGHT_VERSION, "e2e_latency": time.monotonic() - received}
        if self.item.return_logprob:
            inputs, input_tops = self._input()
            meta["input_token_logprobs"] = inputs
            meta["output_token_logprobs"] = [self._entry(t.logprob, t.token_id) for t in self.logprobs]
            if self.item.top_logprobs > 0:
                meta["input_top_logprobs"] = input_tops
                meta["output_top_logprobs"] = [[self._entry(lp, i) for i, lp in t.top] for t in self.logprobs]
        return meta

    def body(self, received: float, index: int | None = None) -> dict:
        out = {"text": "".join(self.parts), "output_ids": list(self.ids), "meta_info": self.meta(received)}
        if index is not None:
            out["index"] = index
        return out
