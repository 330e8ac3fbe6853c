"""Prompt log-probs on the OpenAI surface: ``/v1/completions`` ``echo`` (the prompt before each
completion, with ``logprobs`` its tokens' log-probs too: lm-eval's loglikelihood requests, also with
``max_tokens: 0``) and vLLM's ``prompt_logprobs`` (chat and completions). The engine sends a
prompt's log-probs once, on branch 0's first chunk (``Chunk.prompt_logprobs``, from the first prompt
token on: its logprob is ``None``); every choice of that prompt shows them."""

from __future__ import annotations

from dataclasses import dataclass

from shared.errors import InvalidArgument
from services.tokenizer.generation import Chunk, TokenLogprob
from services.tokenizer.http import protocol as api
from services.tokenizer.http.convert import ChatFormat, ChoiceAcc, CompletionFormat, TokenTexts
from services.tokenizer.validation import MAX_TOP_LOGPROBS


def vllm_prompt_logprobs(lps: list[TokenLogprob], tokens: TokenTexts, k: int) -> list[dict | None]:
    """vLLM's shape: per prompt token ``None`` (the first) or ``{token id: {logprob, rank, decoded_token}}``
    with the prompt's own token and its ``k`` most likely alternatives (``rank``: 1 for the most likely;
    ``None`` for the prompt's token when it is not among them)."""
    out: list[dict | None] = []
    for t in lps:
        if t.logprob is None:
            out.append(None)
            continue
        entry = {}
        own_rank = None
        for rank, (tid, lp) in enumerate(t.top[:k], 1):
            entry[str(tid)] = {"logprob": lp, "rank": rank, "decoded_token": tokens(tid)}
            if tid == t.token_id:
                own_rank = rank
        entry[str(t.token_id)] = {"logprob": t.logprob, "rank": own_rank, "decoded_token": tokens(t.token_id)}
        out.append(entry)
    return out


def check(stream: bool, prompt_logprobs: int | None) -> None:
    if prompt_logprobs is None:
        return
    if not 0 <= prompt_logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidArgument(f"prompt_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {prompt_logprobs}")
    if stream:
        raise InvalidArgument("prompt_logprobs is not available when stream is true")


@dataclass
class EchoPrompt:
    """What ``echo`` puts before a prompt's completions: its text and (filled in from the first
    chunk) its tokens' log-probs."""

    text: str
    scores: list[TokenLogprob] | None = None


class ScoringCompletionFormat(CompletionFormat):
    """Completions with ``echo`` and / or ``prompt_logprobs``: choice ``i·n + j`` is branch ``j`` of prompt ``i``."""

    def __init__(self, tokens: TokenTexts, logprobs: int | None, n: int, prompts: list[EchoPrompt] | None,
                 prompt_logprobs: int | None) -> None:
        super().__init__(tokens, logprobs is not None)
        self.k, self.n, self.echo, self.prompt_k = logprobs or 0, n, prompts, prompt_logprobs
        self._scores: dict[int, list[TokenLogprob]] = {}  # prompt → its log-probs
        self._echoed: set[int] = set()  # streamed choices whose prompt went out

    def _take(self, index: int, c: Chunk) -> list[TokenLogprob] | None:
        prompt = index // self.n
        if c.prompt_logprobs is not None:
            self._scores[prompt] = c.prompt_logprobs
        return self._scores.get(prompt)

    def _echo_logprobs(self, lps: list[TokenLogprob]) -> list[TokenLogprob]:
        # OpenAI's echo: the prompt tokens' entries in the same lists (the first one's logprob null),
        # each with the k most likely alternatives
        return [TokenLogprob(t.token_id, t.logprob, t.top[:self.k]) for t in lps]

    def _logprobs(self, index: int, lps: list[TokenLogprob] | None) -> api.CompletionLogprobs | None:
        out = super()._logprobs(index, lps)
        if out is not None:  # the first token of an echoed prompt has no logprob and no alternatives
            out.top_logprobs = [None if t.logprob is None else top  # type: ignore[misc]
                                for t, top in zip(lps or (), out.top_logprobs)]
        return out

    def _choice(self, index: int, c: Chunk, text: str, lps: list[TokenLogprob] | None,
                echo: bool) -> api.CompletionChoice:
        scores = self._take(index, c)
        prompt_part, prompt_lps = "", []
        if echo and self.echo is not None:
            prompt_part = self.echo[index // self.n].text
            if self.want_logprobs:
                if scores is None:
                    raise InvalidArgument("echo with logprobs: the prompt's log-probs did not come")
                prompt_lps = self._echo_logprobs(scores)
        all_lps = prompt_lps + list(lps or ()) if self.want_logprobs else None
        choice = api.CompletionChoice(index=index, text=prompt_part + text, finish_reason=c.finish or None,
                                      logprobs=self._logprobs(index, all_lps) if all_lps is not None else None,
                                      stop_reason=_stop_reason(c))
        if self.prompt_k is not None and echo:
            choice.prompt_logprobs = vllm_prompt_logprobs(scores or [], self.tokens, self.prompt_k)
        return choice

    def delta(self, index: int, c: Chunk) -> api.CompletionChoice | None:
        first = index not in self._echoed
        if not (c.text or c.finish or c.logprobs or first):
            return None
        self._echoed.add(index)
        return self._choice(index, c, c.text, c.logprobs, first)

    def response(self, rid: str, created: int, model: str, choices: dict[int, ChoiceAcc],
                 usage: api.Usage) -> api.Completion:
        for i, a in sorted(choices.items()):  # (the prompt's log-probs came with branch 0, maybe not choice i)
            if a.prompt_logprobs is not None:
                self._scores[i // self.n] = a.prompt_logprobs
        out = []
        for i, a in sorted(choices.items()):
            last = a.last or Chunk(0, [], "")
            merged = Chunk(last.index, [], "".join(a.texts), last.finish, last.usage, last.matched_stop,
                           last.matched_stop_token_id)
            out.append(self._choice(i, merged, merged.text, a.logprobs, True))
        return api.Completion(id=rid, created=created, model=model, usage=usage, choices=out)


def _stop_reason(c: Chunk) -> str | int | None:
    return c.matched_stop or c.matched_stop_token_id


class ScoringChatFormat:
    """A chat format (plain, or with tool calls / reasoning) plus vLLM's ``prompt_logprobs`` (a field
    of the response, not of a choice; never streamed)."""

    def __init__(self, inner: ChatFormat, prompt_logprobs: int) -> None:
        self.inner, self.tokens, self.prompt_k = inner, inner.tokens, prompt_logprobs

    def __getattr__(self, name: str):  # opening, delta, chunk: the inner format's
        return getattr(self.inner, name)

    def response(self, rid: str, created: int, model: str, choices: dict[int, ChoiceAcc],
                 usage: api.Usage) -> api.ChatCompletion:
        out = self.inner.response(rid, created, model, choices, usage)
        scores = next((a.prompt_logprobs for a in choices.values() if a.prompt_logprobs is not None), [])
        out.prompt_logprobs = vllm_prompt_logprobs(scores, self.tokens, self.prompt_k)
        return out
