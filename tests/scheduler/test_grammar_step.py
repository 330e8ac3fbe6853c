"""The per-step grammar work (bitmask fill into a reused buffer, the stop check, cached jump-forward
encodings, the deferred StepMask) gives what xgrammar gives one matcher at a time."""

from __future__ import annotations

import json

import numpy as np
import pytest

from services.scheduler import grammar as grammar_mod
from services.scheduler.batcher import Scheduled
from services.scheduler.grammar import GrammarBackend, early_tokenizer
from services.scheduler.request import Req, Status
from services.scheduler.step_io import deferred_mask
from shared.messages.common import Constraint, SamplingParams, i32
from shared.messages.to_worker import ForwardBatch

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,4}$"},
                                           "role": {"enum": ["admin", "user"]}},
          "required": ["name", "role"], "additionalProperties": False}
# states of one matcher each: the start, inside a string, before a forced key, inside an enum
PREFIXES = ['', '{"name": "ab', '{"name": "ab"', '{"name": "ab", "role": "a']


@pytest.fixture(scope="module")
def backend(demo_dir):
    cfg = json.load(open(f"{demo_dir}/config.json"))
    g = GrammarBackend(demo_dir, cfg["vocab_size"], cfg["eos_token_id"], tokenizer=early_tokenizer(demo_dir))
    g.wait_ready()
    yield g
    g.close()


def test_a_failed_early_tokenizer_is_loaded_again(demo_dir, tmp_path):
    """The scheduler's early tokenizer load (``early_tokenizer``, started before the worker is ready) failing
    costs nothing but the time: the compiler's build loads it itself, and compiles work."""
    cfg = json.load(open(f"{demo_dir}/config.json"))
    early = early_tokenizer(str(tmp_path / "nowhere"))
    g = GrammarBackend(demo_dir, cfg["vocab_size"], cfg["eos_token_id"], tokenizer=early)
    try:
        g.wait_ready()
        assert early.exception() is not None and g.tokenizer is not None
        assert compiled(g, "regex", "[ab]{2}") is not None
    finally:
        g.close()


def compiled(g: GrammarBackend, kind: str, value: str):
    g.submit([], Constraint(kind=kind, value=value))
    p = g.pending.pop()
    return p.future.result()


def matchers(g: GrammarBackend, prefixes=PREFIXES) -> list:
    c = compiled(g, "json_schema", json.dumps(SCHEMA))
    out = []
    for text in prefixes:
        m = g._matcher(c)
        assert m.accept_string(text) if text else True
        out.append(m)
    return out


def one_mask(g: GrammarBackend, m) -> np.ndarray:
    import xgrammar as xgr

    mask = xgr.allocate_token_bitmask(1, g.vocab_size)
    m.fill_next_token_bitmask(mask, 0)
    return mask.numpy()[0]


@pytest.mark.parametrize("parallel_rows", [1, 1000])  # the threaded and the serial filler
def test_bitmask_rows_match_single_fills_and_others_allow_all(backend, monkeypatch, parallel_rows):
    monkeypatch.setattr(grammar_mod, "PARALLEL_FILL_ROWS", parallel_rows)
    ms = matchers(backend)
    want = [one_mask(backend, m) for m in ms]
    got = backend.bitmask(ms).copy()
    assert got.shape == (len(ms), (backend.vocab_size + 31) // 32)
    assert all((got[k] == want[k]).all() for k in range(len(ms)))
    # into chosen rows of a larger mask (the buffer is reused: stale rows must not leak)
    rows = [5, 1, 3, 0]
    got = backend.bitmask(ms, rows, 7)
    for k, r in enumerate(rows):
        assert (got[r] == want[k]).all()
    assert (got[[2, 4, 6]] == -1).all()
    assert backend.bitmask([], [], 3).tolist() == np.full((3, got.shape[1]), -1).tolist()


def test_only_stop_left(backend):
    done, partial = matchers(backend, ['{"name": "ab", "role": "user"}', '{"name": "ab", "role": "user"'])
    assert backend.only_stop_left(done)
    assert not backend.only_stop_left(partial)  # not complete
    more = backend._matcher(compiled(backend, "regex", "[a-z]{1,3}"))
    assert more.accept_string("ab")
    assert more.is_completed() and not backend.only_stop_left(more)  # complete, but may go on
    assert more.accept_string("c") and backend.only_stop_left(more)


def test_jump_forward_encodes_each_forced_string_once(backend, monkeypatch):
    calls = []
    encode = backend.tokenizer.encode
    monkeypatch.setattr(backend, "_forced_ids", {})
    monkeypatch.setattr(backend.tokenizer, "encode", lambda s, **kw: calls.append(s) or encode(s, **kw))
    outs = []
    for _ in range(3):
        m, = matchers(backend, ['{"name": "ab"'])
        outs.append(backend.jump_forward(m, 100))
    assert outs[0] and outs[0] == outs[1] == outs[2]
    assert backend.tokenizer.decode(outs[0]) == ', "role": "'
    assert len(calls) == 1
    m, = matchers(backend, ['{"name": "ab"'])
    assert backend.jump_forward(m, 1) == outs[0][:1]  # the budget cuts it


def test_deferred_mask_allows_everything_where_the_sample_is_dropped(backend):
    ms = matchers(backend)
    params = SamplingParams(max_new_tokens=8)
    reqs = [Req(rid=f"r{i}", replica=b"t", prompt=[5, 6], params=params, status=Status.RUNNING) for i in range(6)]
    for r, m in zip(reqs, ms + [None, ms[0]]):
        r.matcher = m
    reqs[1].status = Status.FINISHED
    reqs[3].discard = 1
    sample = [True, True, True, True, True, False]  # reqs[4]: no grammar; reqs[5]: does not sample
    msg = ForwardBatch(step_id=7, new_reqs=[], released_rows=[], rows=i32(range(6)), prefix_lens=i32([1] * 6),
                       extend_lens=i32([1] * 6), emits=i32(sample), input_ids=i32([-1] * 6), out_slots=i32(range(6)))
    out = deferred_mask(Scheduled(7, reqs, [1] * 6, sample, 6, 0, msg), backend)
    mask = np.frombuffer(out.bitmask, dtype=np.int32).reshape(4, -1)  # rows 0-3 have a grammar and sample
    assert out.step_id == 7
    assert (mask[0] == one_mask(backend, ms[0])).all() and (mask[2] == one_mask(backend, ms[2])).all()
    assert (mask[1] == -1).all() and (mask[3] == -1).all()
