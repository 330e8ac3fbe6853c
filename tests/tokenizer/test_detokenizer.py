"""Incremental detokenization and stop strings, on the demo tokenizer and (if present) Llama 3's."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers.pre_tokenizers import ByteLevel
from transformers import AutoTokenizer

from banyan.demo import ensure_demo_model
from services.tokenizer.detokenizer import IncrementalDetokenizer

LLAMA3_DIR = Path("/work/shared/assets/tokenizers/llama3")

_PIECES = [
    "hello", " world", " the", " ", "  ", "\n", "\n\n", "\t", ".", ",", "!", "?", "'s", " don't",
    "é", "ü", "ñ", "ø", "ß", "中", "文", "你好", "日本語", "한국", "Ω", "ж", "€", "—", "…",
    "😀", "🎉", "🚀", "👩‍💻", "🇵🇹", "❤️", "123", " 4.5", "0x1F", "def f(x):", "<|im_end|>", "\ufffd",
]
texts = st.lists(st.one_of(st.sampled_from(_PIECES), st.text(max_size=3)), max_size=25).map("".join)
SETTINGS = settings(max_examples=100, deadline=None)


# the demo tokenizer always; the real Llama 3 one too where the team assets are (not in CI)
@pytest.fixture(scope="module", params=["demo"] + (["llama3"] if LLAMA3_DIR.is_dir() else []))
def tok(request, tmp_path_factory):
    if request.param == "demo":
        return AutoTokenizer.from_pretrained(ensure_demo_model(str(tmp_path_factory.mktemp("cache"))))
    return AutoTokenizer.from_pretrained(LLAMA3_DIR)


def _byte_ids(tok) -> list[int]:
    """Id of the single-byte token of each byte value 0..255 (GPT-2 byte-to-unicode mapping)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    chars = [chr(b) if b in printable else chr(next(extra)) for b in range(256)]
    ids = tok.convert_tokens_to_ids(chars)
    assert sorted(chars) == sorted(ByteLevel.alphabet()) and None not in ids
    return ids


def _encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def _chunks(data, ids: list[int]) -> list[list[int]]:
    out, i = [], 0
    while i < len(ids):
        n = data.draw(st.integers(1, 8), label="chunk")
        out.append(ids[i : i + n])
        i += n
    return out


def _stream(det: IncrementalDetokenizer, chunks: list[list[int]], expected: str) -> str:
    """Push every chunk then finish; everything streamed must stay a prefix of ``expected``."""
    out = []
    for chunk in chunks:
        out.append(det.push(chunk))
        assert expected.startswith(det.text)
    out.append(det.finish())
    assert "".join(out) == det.text
    return det.text


@SETTINGS
@given(data=st.data())
def test_stream_equals_full_decode(tok, data):
    prompt, output = data.draw(texts, label="prompt"), data.draw(texts, label="output")
    skip = data.draw(st.booleans(), label="skip_special_tokens")
    prompt_ids = tok.encode(prompt)  # with the BOS: a realistic prompt
    ids = _encode(tok, output)
    expected = tok.decode(ids, skip_special_tokens=skip)
    det = IncrementalDetokenizer(tok, prompt_ids, skip_special_tokens=skip, stop=[])
    assert _stream(det, _chunks(data, ids), expected) == expected
    assert not det.stopped and det.matched_stop is None


@SETTINGS
@given(data=st.data())
def test_random_ids_equal_full_decode(tok, data):
    """Arbitrary ids (lone bytes, split characters, specials) stream to exactly the full decode."""
    byte_ids = _byte_ids(tok)
    special_ids = sorted(tok.added_tokens_decoder)[:8]
    pool = st.one_of(st.integers(0, len(tok) - 1), st.sampled_from(byte_ids), st.sampled_from(special_ids))
    ids = data.draw(st.lists(pool, max_size=40), label="ids")
    skip = data.draw(st.booleans(), label="skip_special_tokens")
    prompt_ids = data.draw(st.lists(pool, max_size=8), label="prompt")  # may end inside a character
    expected = tok.decode(ids, skip_special_tokens=skip)
    det = IncrementalDetokenizer(tok, prompt_ids, skip_special_tokens=skip)
    assert _stream(det, _chunks(data, ids), expected) == expected


def _reference_stop(text: str, stops: list[str]) -> tuple[str, str | None]:
    """The stop string that completes first (ties: starts first) and the text before it."""
    hits = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
    if not hits:
        return text, None
    _, start, stop = min(hits)
    return text[:start], stop


@SETTINGS
@given(data=st.data())
def test_stop_strings_property(tok, data):
    output = data.draw(texts, label="output")
    ids = _encode(tok, output)
    full = tok.decode(ids, skip_special_tokens=True)
    substrings = st.integers(0, len(full) - 1).flatmap(lambda i: st.integers(i + 1, len(full)).map(lambda j: full[i:j]))
    stop_st = st.one_of(st.text(min_size=1, max_size=4), substrings) if full else st.text(min_size=1, max_size=4)
    stops = data.draw(st.lists(stop_st, max_size=3), label="stops")
    expected, matched = _reference_stop(full, stops)
    det = IncrementalDetokenizer(tok, [], skip_special_tokens=True, stop=stops)
    assert _stream(det, _chunks(data, ids), expected) == expected
    assert det.stopped == (matched is not None) and det.matched_stop == matched
    assert not any(s in det.text for s in stops)


def _push_one_by_one(det: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [det.push([i]) for i in ids]


def test_stop_split_across_tokens(tok):
    ids = _encode(tok, "Hello world, STOP NOW please and more text")
    assert not any("STOP NOW" in tok.decode([i]) for i in ids)  # the stop spans several tokens
    det = IncrementalDetokenizer(tok, _encode(tok, "Say:"), stop=["STOP NOW"])
    pieces = _push_one_by_one(det, ids)
    assert det.stopped and det.matched_stop == "STOP NOW"
    assert "".join(pieces) == det.text == "Hello world, "
    assert all("S" not in p for p in pieces)  # no part of the stop string was ever streamed
    assert det.push(_encode(tok, " STOP NOW")) == "" and det.finish() == ""
    assert det.text == "Hello world, "


def test_stop_at_start(tok):
    det = IncrementalDetokenizer(tok, [], stop=["Hello"])
    assert "".join(_push_one_by_one(det, _encode(tok, "Hello world"))) == ""
    assert det.stopped and det.matched_stop == "Hello" and det.finish() == "" and det.text == ""


def test_earliest_stop_wins(tok):
    ids = _encode(tok, "alpha beta gamma delta")
    for chunked in (False, True):
        det = IncrementalDetokenizer(tok, [], stop=["delta", "gamma", "beta"])
        _push_one_by_one(det, ids) if chunked else det.push(ids)
        assert det.text == "alpha " and det.matched_stop == "beta"
    # Overlapping stops: the one completed first wins, however the ids are chunked.
    ids = _encode(tok, "xx abcd yy")
    for chunked in (False, True):
        det = IncrementalDetokenizer(tok, [], stop=["abcd", "bc"])
        _push_one_by_one(det, ids) if chunked else det.push(ids)
        assert det.text == "xx a" and det.matched_stop == "bc"


def test_held_back_text_released_at_finish(tok):
    det = IncrementalDetokenizer(tok, [], stop=["world peace"])
    assert det.push(_encode(tok, "hello world")) == "hello "  # "world" may begin the stop string
    assert det.text == "hello "
    assert det.finish() == "world"
    assert det.text == "hello world" and not det.stopped


def test_special_tokens(tok):
    eos = tok.convert_tokens_to_ids("<|end_of_text|>")
    ids = _encode(tok, "Hi there") + [eos]
    for skip, expected in ((True, "Hi there"), (False, "Hi there<|end_of_text|>")):
        det = IncrementalDetokenizer(tok, [], skip_special_tokens=skip)
        assert "".join(_push_one_by_one(det, ids)) + det.finish() == expected


def test_first_token_keeps_its_space(tok):
    det = IncrementalDetokenizer(tok, _encode(tok, "Hello"))
    assert det.push(_encode(tok, " world")) == " world"


def test_multibyte_char_is_held_until_complete(tok):
    byte_ids = _byte_ids(tok)
    emoji = [byte_ids[b] for b in "😀".encode()]  # four single-byte tokens
    det = IncrementalDetokenizer(tok, [])
    assert [det.push([i]) for i in emoji] == ["", "", "", "😀"]
    # A prompt ending inside a character: the output's bytes do not complete it (decode(output)).
    det = IncrementalDetokenizer(tok, _encode(tok, "Hi ") + emoji[:2])
    out = emoji[2:] + _encode(tok, "A")
    assert det.push(out) + det.finish() == tok.decode(out) == "\ufffd\ufffdA"


def test_window_stays_bounded(tok):
    """Per-push decoding cost is O(window): no growth with output length, skipped specials or junk."""
    sizes: list[int] = []

    class Spy:
        def __init__(self, inner):
            self._inner = inner

        def decode(self, ids, skip_special_tokens):
            sizes.append(len(ids))
            return self._inner.decode(ids, skip_special_tokens=skip_special_tokens)

        def get_added_tokens_decoder(self):
            return self._inner.get_added_tokens_decoder()

    class SpyTokenizer:
        backend_tokenizer = Spy(tok.backend_tokenizer)

    continuation = _byte_ids(tok)[0x80]  # a lone UTF-8 continuation byte
    text_ids = _encode(tok, "Some ordinary text, 你好 😀 and more. " * 20)
    ids = text_ids + [tok.convert_tokens_to_ids("<|end_of_text|>")] * 500 + [continuation] * 500 + text_ids
    det = IncrementalDetokenizer(SpyTokenizer(), tok.encode("A prompt " * 50))
    streamed = "".join(_push_one_by_one(det, ids)) + det.finish()
    assert streamed == tok.decode(ids, skip_special_tokens=True)
    assert max(sizes) <= 16


def test_api_errors(tok):
    with pytest.raises(ValueError):
        IncrementalDetokenizer(tok, [], stop=["ok", ""])
    det = IncrementalDetokenizer(tok, [], stop=["done!"])
    assert det.push(_encode(tok, "done")) == ""
    assert det.finish() == "done" and det.finish() == ""
    with pytest.raises(RuntimeError):
        det.push([1])
