"""OpenAI requests → ``Prompt`` / ``SamplingRequest`` (then ``validation.prepare``, as for gRPC),
and generation ``Chunk``s → OpenAI choices, logprobs and usage."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field

from shared.errors import InvalidArgument
from shared.messages.common import Constraint
from services.tokenizer.generation import Chunk, TokenLogprob, Usage
from services.tokenizer.http import protocol as api
from services.tokenizer.http.history import message_fields
from services.tokenizer.text import Message, TextProcessor
from services.tokenizer.validation import MAX_TOP_LOGPROBS, Prompt, SamplingRequest

MAX_PROMPTS = 64  # prompts in one /v1/completions request


def constraint(req: api.CompletionRequest | api.ChatCompletionRequest) -> Constraint | None:
    """The structured-output constraint: ``response_format`` (json_object / json_schema) or one of
    the extensions ``regex``, ``ebnf``, ``choice``. ``validation.prepare`` checks it further and the
    scheduler compiles it (a grammar that does not compile fails the request with a 400)."""
    found = []
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        found.append(Constraint("json_object"))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise InvalidArgument("response_format.json_schema.schema is required when type is json_schema")
        found.append(Constraint("json_schema", value=json.dumps(rf.json_schema.schema_)))
    if req.regex is not None:
        found.append(Constraint("regex", value=req.regex))
    if req.ebnf is not None:
        found.append(Constraint("ebnf", value=req.ebnf))
    if req.choice is not None:
        found.append(Constraint("choice", choices=list(req.choice)))
    if len(found) > 1:
        raise InvalidArgument("give at most one of response_format (json_object / json_schema), regex, ebnf "
                              "and choice")
    return found[0] if found else None


def messages(msgs: list[api.ChatMessage], name: str = "messages") -> list[Message]:
    """Chat messages for the template; text parts of a message are joined with newlines."""
    out = []
    for i, m in enumerate(msgs):
        role = "system" if m.role == "developer" else m.role  # (OpenAI's newer name; templates know system)
        if m.content is None or isinstance(m.content, str):
            out.append(Message(role, m.content or "", **message_fields(m, i)))
            continue
        texts = []
        for j, part in enumerate(m.content):
            if part.type != "text" or part.text is None:
                raise InvalidArgument(f"{name}[{i}].content[{j}]: only text parts are supported, got {part.type!r}")
            texts.append(part.text)
        out.append(Message(role, "\n".join(texts), **message_fields(m, i)))
    return out


def _sampling(req: api.CompletionRequest | api.ChatCompletionRequest, max_tokens: int | None, logprobs: bool,
              top_logprobs: int | None, prompt_top: int | None = None) -> SamplingRequest:
    """``prompt_top``: prompt log-probs from the first token, with that many alternatives (``None``: none)."""
    if req.stream_options is not None and not req.stream:
        raise InvalidArgument("stream_options is only allowed when stream is true")
    stop = [] if req.stop is None else [req.stop] if isinstance(req.stop, str) else list(req.stop)
    return SamplingRequest(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                           min_p=req.min_p, seed=req.seed, n=req.n, stop=stop,
                           stop_token_ids=list(req.stop_token_ids or ()), ignore_eos=req.ignore_eos,
                           skip_special_tokens=req.skip_special_tokens, presence_penalty=req.presence_penalty,
                           frequency_penalty=req.frequency_penalty, logprobs=logprobs, top_logprobs=top_logprobs,
                           stream_interval=req.stream_interval,
                           prompt_logprobs_start=None if prompt_top is None else 0, prompt_top_logprobs=prompt_top,
                           logit_bias=logit_bias(req.logit_bias), min_tokens=req.min_tokens,
                           repetition_penalty=req.repetition_penalty)


def logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's ``logit_bias`` keys are token ids written as strings."""
    if not bias:
        return None
    out = {}
    for key, value in bias.items():
        if not key.strip().isdigit():
            raise InvalidArgument(f"logit_bias: the key {key[:40]!r} is not a token id (a non-negative integer)")
        out[int(key)] = value
    return out


def chat_request(req: api.ChatCompletionRequest) -> tuple[Prompt, SamplingRequest, Constraint | None]:
    if req.top_logprobs and not req.logprobs:
        raise InvalidArgument("top_logprobs requires logprobs to be true")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    prompt = Prompt(messages=messages(req.messages), add_generation_prompt=req.add_generation_prompt)
    top = req.top_logprobs if req.logprobs else None
    return prompt, _sampling(req, max_tokens, req.logprobs, top, req.prompt_logprobs), constraint(req)


def completion_request(req: api.CompletionRequest) -> tuple[list[Prompt], SamplingRequest, Constraint | None]:
    if req.suffix:
        raise InvalidArgument("suffix is not supported")
    if req.best_of not in (None, 1):
        raise InvalidArgument("best_of is not supported (only 1): use n for several completions")
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidArgument(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {req.logprobs}")
    logprobs = req.logprobs is not None
    if req.echo and logprobs and req.stream and (req.n or 1) > 1:
        raise InvalidArgument("echo with logprobs streams one choice per prompt: n must be 1 with stream")
    wanted = [k for k in (req.logprobs if req.echo else None, req.prompt_logprobs) if k is not None]
    prompt_top = max(wanted) if wanted else None  # (echo's alternatives and vLLM's prompt_logprobs: the most)
    return (_prompts(req.prompt), _sampling(req, req.max_tokens, logprobs, req.logprobs, prompt_top),
            constraint(req))


def _prompts(p: str | list[str] | list[int] | list[list[int]]) -> list[Prompt]:
    if isinstance(p, str):
        return [Prompt(text=p)]
    if not p:
        raise InvalidArgument("prompt must not be empty")
    if isinstance(p[0], int):
        return [Prompt(token_ids=list(p))]  # type: ignore[arg-type]
    if len(p) > MAX_PROMPTS:
        raise InvalidArgument(f"prompt has {len(p)} prompts (at most {MAX_PROMPTS})")
    return [Prompt(text=x) if isinstance(x, str) else Prompt(token_ids=list(x)) for x in p]


# ----- outputs -----

def _byte_decoder(text: TextProcessor) -> dict[str, int] | None:
    """Byte-level BPE (GPT-2, Llama 3, Qwen) spells each byte as one printable character; this maps
    them back, so a token's ``bytes`` are exact even when it ends inside a UTF-8 character."""
    try:
        spec = json.loads(text.tokenizer.backend_tokenizer.to_str()).get("decoder") or {}
    except AttributeError:  # a slow (Python) tokenizer
        return None
    if "ByteLevel" not in {spec.get("type")} | {d.get("type") for d in spec.get("decoders") or ()}:
        return None
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    rest = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(rest)}


class TokenTexts:
    """A token id's text (decoded on its own, special tokens kept) and its bytes, cached per id."""

    def __init__(self, text: TextProcessor) -> None:
        self._text = text
        self._bytes_of = _byte_decoder(text)
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def _get(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            s = self._text.decode([token_id], skip_special_tokens=False)
            raw = s.encode()
            if self._bytes_of is not None:
                piece = self._text.tokenizer.convert_ids_to_tokens(token_id)
                if piece and all(ch in self._bytes_of for ch in piece):  # (not added/special tokens)
                    raw = bytes(self._bytes_of[ch] for ch in piece)
            hit = self._cache[token_id] = (s, list(raw))
        return hit

    def __call__(self, token_id: int) -> str:
        return self._get(token_id)[0]

    def entry(self, token_id: int, logprob: float) -> api.TopLogprob:
        s, raw = self._get(token_id)
        return api.TopLogprob(token=s, logprob=logprob, bytes=raw)


def stop_reason(c: Chunk) -> str | int | None:
    return c.matched_stop or c.matched_stop_token_id


@dataclass
class ChoiceAcc:
    """One choice of a non-streamed response, gathered from its chunks."""

    texts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    last: Chunk | None = None
    prompt_logprobs: list[TokenLogprob] | None = None

    def add(self, c: Chunk) -> None:
        self.texts.append(c.text)
        if c.prompt_logprobs is not None:
            self.prompt_logprobs = c.prompt_logprobs
        self.logprobs.extend(c.logprobs or ())
        if c.finish:
            self.last = c


class UsageAcc:
    """Usage over choices: each prompt counts once (its cached tokens: the least any branch reused)."""

    def __init__(self) -> None:
        self._prompts: dict[int, tuple[int, int]] = {}
        self._completion = 0

    def add(self, prompt: int, u: Usage) -> None:
        self._completion += u.completion_tokens
        tokens, cached = self._prompts.get(prompt, (u.prompt_tokens, u.cached_tokens))
        self._prompts[prompt] = (tokens, min(cached, u.cached_tokens))

    def usage(self) -> api.Usage:
        prompt = sum(t for t, _ in self._prompts.values())
        cached = sum(c for _, c in self._prompts.values())
        return api.Usage(prompt_tokens=prompt, completion_tokens=self._completion,
                         total_tokens=prompt + self._completion,
                         prompt_tokens_details=api.PromptTokensDetails(cached_tokens=cached))


class RunningUsage:
    """Usage so far, for ``stream_options.continuous_usage_stats``: every prompt's tokens and the
    completion tokens streamed until now (cached tokens once a choice has ended)."""

    def __init__(self, prompt_tokens: Iterable[int]) -> None:
        self._prompt = sum(prompt_tokens)
        self._completion = 0
        self._cached: int | None = None

    def add(self, c: Chunk) -> api.Usage:
        self._completion += len(c.token_ids)
        if c.usage is not None:
            self._cached = c.usage.cached_tokens if self._cached is None else min(self._cached, c.usage.cached_tokens)
        return api.Usage(prompt_tokens=self._prompt, completion_tokens=self._completion,
                         total_tokens=self._prompt + self._completion,
                         prompt_tokens_details=api.PromptTokensDetails(cached_tokens=self._cached or 0))


class ChatFormat:
    """Chat completion objects; ``logprobs`` as ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""

    def __init__(self, tokens: TokenTexts, logprobs: bool) -> None:
        self.tokens, self.want_logprobs = tokens, logprobs

    def _logprobs(self, lps: list[TokenLogprob] | None) -> api.ChatLogprobs | None:
        if not self.want_logprobs:
            return None
        return api.ChatLogprobs(content=[
            api.TokenLogprob(**dict(self.tokens.entry(t.token_id, t.logprob)),
                             top_logprobs=[self.tokens.entry(i, lp) for i, lp in t.top]) for t in lps or ()])

    def opening(self, index: int) -> api.ChatChunkChoice:
        return api.ChatChunkChoice(index=index, delta=api.Delta(role="assistant", content=""))

    def delta(self, index: int, c: Chunk) -> api.ChatChunkChoice | None:
        if not (c.text or c.finish or c.logprobs):
            return None
        return api.ChatChunkChoice(index=index, delta=api.Delta(content=c.text or None),
                                   logprobs=self._logprobs(c.logprobs) if c.logprobs else None,
                                   finish_reason=c.finish or None, stop_reason=stop_reason(c))

    def chunk(self, rid: str, created: int, model: str, choices: list, usage: api.Usage | None) -> str:
        msg = api.ChatCompletionChunk(id=rid, created=created, model=model, choices=choices, usage=usage)
        return msg.model_dump_json(exclude=None if usage else {"usage"})

    def response(self, rid: str, created: int, model: str, choices: dict[int, ChoiceAcc],
                 usage: api.Usage) -> api.ChatCompletion:
        return api.ChatCompletion(id=rid, created=created, model=model, usage=usage, choices=[
            api.ChatChoice(index=i, message=api.AssistantMessage(content="".join(a.texts)),
                           logprobs=self._logprobs(a.logprobs), finish_reason=a.last.finish if a.last else None,
                           stop_reason=stop_reason(a.last) if a.last else None)
            for i, a in sorted(choices.items())])


class CompletionFormat:
    """Text completion objects; ``logprobs`` as ``{tokens, token_logprobs, top_logprobs, text_offset}``."""

    def __init__(self, tokens: TokenTexts, logprobs: bool) -> None:
        self.tokens, self.want_logprobs = tokens, logprobs
        self._offsets: dict[int, int] = {}  # per choice: text length of the tokens so far

    def _logprobs(self, index: int, lps: list[TokenLogprob] | None) -> api.CompletionLogprobs | None:
        if not self.want_logprobs:
            return None
        toks, offsets = [], []
        offset = self._offsets.get(index, 0)
        for t in lps or ():
            toks.append(self.tokens(t.token_id))
            offsets.append(offset)
            offset += len(toks[-1])
        self._offsets[index] = offset
        return api.CompletionLogprobs(tokens=toks, token_logprobs=[t.logprob for t in lps or ()], text_offset=offsets,
                                      top_logprobs=[{self.tokens(i): lp for i, lp in t.top} for t in lps or ()])

    def opening(self, index: int) -> None:
        return None

    def delta(self, index: int, c: Chunk) -> api.CompletionChoice | None:
        if not (c.text or c.finish or c.logprobs):
            return None
        return api.CompletionChoice(index=index, text=c.text, finish_reason=c.finish or None,
                                    logprobs=self._logprobs(index, c.logprobs) if c.logprobs else None,
                                    stop_reason=stop_reason(c))

    def chunk(self, rid: str, created: int, model: str, choices: list, usage: api.Usage | None) -> str:
        msg = api.Completion(id=rid, created=created, model=model, choices=choices, usage=usage)
        return msg.model_dump_json(exclude=None if usage else {"usage"})

    def response(self, rid: str, created: int, model: str, choices: dict[int, ChoiceAcc],
                 usage: api.Usage) -> api.Completion:
        return api.Completion(id=rid, created=created, model=model, usage=usage, choices=[
            api.CompletionChoice(index=i, text="".join(a.texts), logprobs=self._logprobs(i, a.logprobs),
                                 finish_reason=a.last.finish if a.last else None,
                                 stop_reason=stop_reason(a.last) if a.last else None)
            for i, a in sorted(choices.items())])
