"""Unit tests of the HTTP front's pure parts: API key check, OpenAI → internal conversion, usage
accounting, validation-error messages and the stream merge (no server)."""

from __future__ import annotations

import asyncio

import pytest

from shared.errors import InvalidArgument
from services.tokenizer.auth import ApiKey
from services.tokenizer.generation import Usage
from services.tokenizer.http import convert
from services.tokenizer.http import protocol as api
from services.tokenizer.http.errors import _field
from services.tokenizer.http.streams import merge


def test_api_key():
    assert ApiKey("").allows(None) and not ApiKey("").required
    key = ApiKey("s3cret")
    assert key.required and key.allows("Bearer s3cret") and key.allows("bearer  s3cret ")
    assert key.allows(b"Bearer s3cret")
    assert ApiKey("ключ").allows("Bearer ключ".encode())
    for bad in (None, "", "s3cret", "Basic s3cret", "Bearer s3cre", "Bearer s3cret2", "Bearer \ud800",
                b"Bearer \xff"):
        assert not key.allows(bad), bad


def test_chat_conversion():
    req = api.ChatCompletionRequest(
        messages=[{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                  {"role": "developer", "content": ""}],
        max_tokens=5, max_completion_tokens=7, stop="x", logprobs=True, top_logprobs=3, top_k=4, seed=1,
        stream_interval=8)
    prompt, s, constraint = convert.chat_request(req)
    assert s.stream_interval == 8  # (an extension: validated with the rest, [1, 1024])
    assert [(m.role, m.content) for m in prompt.messages] == [("system", "Be brief."), ("user", "a\nb"),
                                                             ("system", "")]
    assert (s.max_tokens, s.stop, s.logprobs, s.top_logprobs, s.top_k, s.seed) == (7, ["x"], True, 3, 4, 1)
    assert constraint is None
    with pytest.raises(InvalidArgument, match="only text parts"):
        convert.chat_request(api.ChatCompletionRequest(messages=[{"role": "user", "content": [{"type": "image_url"}]}]))
    with pytest.raises(InvalidArgument, match="top_logprobs requires logprobs"):
        convert.chat_request(api.ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], top_logprobs=1))


def test_completion_prompts_and_constraints():
    def prompts(p):
        return convert.completion_request(api.CompletionRequest(prompt=p))[0]

    assert prompts("hi")[0].text == "hi" and prompts([1, 2])[0].token_ids == [1, 2]
    assert [p.text for p in prompts(["a", "b"])] == ["a", "b"]
    assert [p.token_ids for p in prompts([[1], [2, 3]])] == [[1], [2, 3]]
    with pytest.raises(InvalidArgument, match="empty"):
        prompts([])
    _, s, c = convert.completion_request(api.CompletionRequest(prompt="x", logprobs=2, regex="a+"))
    assert (s.max_tokens, s.logprobs, s.top_logprobs) == (16, True, 2) and (c.kind, c.value) == ("regex", "a+")
    schema = {"type": "object"}
    c = convert.constraint(api.ChatCompletionRequest(messages=[], response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}))
    assert (c.kind, c.value) == ("json_schema", '{"type": "object"}')
    assert convert.constraint(api.CompletionRequest(prompt="x", response_format={"type": "text"})) is None
    assert convert.constraint(api.CompletionRequest(prompt="x", choice=["a", "b"])).choices == ["a", "b"]
    with pytest.raises(InvalidArgument, match="at most one"):
        convert.constraint(api.CompletionRequest(prompt="x", regex="a", response_format={"type": "json_object"}))


def test_usage_counts_each_prompt_once():
    acc = convert.UsageAcc()
    acc.add(0, Usage(10, 4, 1))
    acc.add(0, Usage(10, 5, 9))  # a second branch of prompt 0 reused the first one's prefill
    acc.add(1, Usage(7, 2, 0))
    u = acc.usage()
    assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (17, 11, 28)
    assert u.prompt_tokens_details.cached_tokens == 1


def test_validation_error_field_names():
    assert _field(("body", "prompt", "list[constrained-int]", 0)) == "prompt.0"
    assert _field(("body", "messages", 1, "content", "function-after[_unicode(), str]")) == "messages.1.content"
    assert _field(("body",)) == ""


def test_merge_interleaves_and_closes_every_stream():
    closed: list[int] = []

    async def gen(i: int, n: int, fail: bool = False):
        try:
            for k in range(n):
                await asyncio.sleep(0)
                yield i * 100 + k
            if fail:
                raise InvalidArgument("boom")
            await asyncio.sleep(3600)  # never ends by itself
            yield -1
        finally:
            closed.append(i)

    async def early_close():
        m = merge([gen(0, 3), gen(1, 3)])
        got = [await anext(m) for _ in range(6)]
        await m.aclose()
        return got

    got = asyncio.run(early_close())
    assert sorted(x for _, x in got) == [0, 1, 2, 100, 101, 102] and sorted(closed) == [0, 1]
    assert all(i == x // 100 for i, x in got)

    closed.clear()

    async def failing():
        return [x async for x in merge([gen(0, 2, fail=True), gen(1, 1)])]

    with pytest.raises(InvalidArgument, match="boom"):
        asyncio.run(failing())
    assert sorted(closed) == [0, 1]


def test_formats_logprobs_offsets_and_chunks(demo_dir):
    import json

    from services.tokenizer.generation import Chunk, TokenLogprob
    from services.tokenizer.text import TextProcessor

    text = TextProcessor(demo_dir)
    tokens = convert.TokenTexts(text)
    ids = text.encode("Hello wide world", add_special_tokens=False)
    lps = [TokenLogprob(t, -0.5 - k, [(t, -0.5 - k), (ids[0], -9.0)]) for k, t in enumerate(ids)]
    first = Chunk(0, ids[:1], text.decode(ids[:1]), logprobs=lps[:1])
    last = Chunk(0, ids[1:], text.decode(ids[1:]), "stop", Usage(3, len(ids), 0), matched_stop="!", logprobs=lps[1:])

    fmt = convert.CompletionFormat(tokens, logprobs=True)
    a, b = fmt.delta(1, first), fmt.delta(1, last)
    toks = a.logprobs.tokens + b.logprobs.tokens
    assert "".join(toks) == "Hello wide world" and a.logprobs.text_offset == [0]
    assert b.logprobs.text_offset == [sum(map(len, toks[:i])) for i in range(1, len(toks))]
    assert b.logprobs.top_logprobs[0] == {toks[1]: -1.5, toks[0]: -9.0}
    assert (a.finish_reason, b.finish_reason, b.stop_reason) == (None, "stop", "!")
    chunk = json.loads(fmt.chunk("cmpl-1", 5, "m", [a], None))
    assert "usage" not in chunk and chunk["choices"][0]["index"] == 1 and chunk["object"] == "text_completion"

    chat = convert.ChatFormat(tokens, logprobs=True)
    acc = convert.ChoiceAcc()
    acc.add(first)
    acc.add(last)
    usage = convert.UsageAcc()
    usage.add(0, last.usage)
    r = chat.response("chatcmpl-1", 5, "m", {0: acc}, usage.usage())
    c = r.choices[0]
    assert c.message.content == "Hello wide world" and c.finish_reason == "stop" and c.stop_reason == "!"
    assert [t.logprob for t in c.logprobs.content] == [lp.logprob for lp in lps]
    assert [len(t.top_logprobs) for t in c.logprobs.content] == [2] * len(ids)
    assert b"".join(bytes(t.bytes) for t in c.logprobs.content) == "Hello wide world".encode()
    assert chat.delta(0, Chunk(0, [5], "")) is None  # nothing to send (text held back)
    assert convert.ChatFormat(tokens, logprobs=False).response("x", 5, "m", {0: acc}, usage.usage()
                                                              ).choices[0].logprobs is None
