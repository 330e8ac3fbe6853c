"""Shared-prefix (cascade) attention: the scheduler's groups and the reference backend's two-level
attention, which must equal plain attention."""

from __future__ import annotations

import sys
from collections import deque

import numpy as np
import pytest
import torch

from tests.cascade_cases import CASES, GROUPED, build
from services.scheduler.batcher import Batcher, Limits
from services.scheduler.cascade import CascadePolicy, plan_groups
from services.scheduler.kv import KVManager
from services.scheduler.policy import POLICIES
from services.worker.attention.base import make_cascade, merge_states
from services.worker.attention.torch_backend import TorchAttention
from shared.messages.common import from_i32
from tests.scheduler.test_scheduler_units import finish_all, req, step


# --- worker: two-level attention ----------------------------------------------------------------


@pytest.mark.parametrize("name", GROUPED)
@pytest.mark.parametrize("heads", [(8, 2, 16), (4, 4, 32)])
def test_torch_cascade_equals_plain_attention(name, heads):
    hq, hkv, d = heads
    pool, plain, grouped, (q, k, v) = build(name, hq, hkv, d, torch.float32, "cpu")
    attn = TorchAttention(pool)
    attn.prepare(plain)
    want = attn.forward(q, k, v, 0)
    attn.prepare(grouped)
    assert attn._groups, "the groups were used"
    got = attn.forward(q, k, v, 0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_merge_states_equals_attention_over_the_union():
    g = torch.Generator().manual_seed(1)
    scores = torch.randn(3, 2, 50, generator=g)  # (T, H, L)
    values = torch.randn(50, 4, generator=g)
    full = torch.einsum("thl,ld->thd", scores.softmax(-1), values)
    parts = []
    for sl in (slice(0, 20), slice(20, 50)):
        s = scores[..., sl]
        parts.append((torch.einsum("thl,ld->thd", s.softmax(-1), values[sl]), torch.logsumexp(s, -1)))
    out, lse = merge_states(*parts[0], *parts[1])
    torch.testing.assert_close(out, full)
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1))


def test_make_cascade_layout():
    # batch: r0 (group 1, 2 tokens), r1 (none, 3), r2 (group 0, 1), r3 (group 1, 1)
    c = make_cascade(np.array([1, -1, 0, 1]), np.array([10, 20]), np.array([7, 8, 9, 6]), np.array([2, 3, 1, 1]),
                     torch.device("cpu"))
    assert c.skip.tolist() == [20, 0, 10, 20]
    assert c.first_rows.tolist() == [9, 7]  # group 0's first member is r2 (row 9), group 1's r0 (row 7)
    assert c.qo_lens.tolist() == [1, 3]
    assert c.q_index.tolist() == [5, 0, 1, 6]  # r2's token, then r0's two and r3's one
    assert c.q_index_dev.tolist() == c.q_index.tolist() and c.leading == 0
    for name in ("decode_leading", "mixed_leading"):  # members first, group by group: read in place
        grouped = build(name, 4, 2, 8, torch.float32, "cpu")[2].cascade
        assert grouped.leading == len(grouped.q_index) > 0
    assert build("decode", 4, 2, 8, torch.float32, "cpu")[2].cascade.leading == 0


# --- scheduler: which requests share what -------------------------------------------------------

SYSTEM = list(range(1000, 1200))  # a 200-token shared prefix


def cascade_batcher(policy: CascadePolicy, pool=8192, rows=64) -> Batcher:
    return Batcher(KVManager(pool, rows), POLICIES["fcfs"](), Limits(rows, 4096, 4096), policy)


def warm(b: Batcher, prompt: list[int]) -> None:
    """Run one request through so ``prompt`` is in the cache."""
    running, waiting = [], deque([req(prompt, max_new=1, rid="warm")])
    step(b, running, waiting)
    finish_all(b, running)


def test_requests_under_one_cached_prefix_form_a_group():
    b = cascade_batcher(CascadePolicy(min_group=3, min_prefix=64, min_saved=0, min_saved_eager=0))
    warm(b, SYSTEM + [1])
    running = []
    waiting = deque(req(SYSTEM + [10 + i, 20 + i], rid=f"q{i}") for i in range(4))
    waiting.append(req(list(range(5000, 5300)), rid="other"))  # shares nothing
    s = step(b, running, waiting)  # prefill: the 4 start after the cached 200 tokens
    assert from_i32(s.msg.cascade_group).tolist() == [0, 0, 0, 0, -1]
    assert from_i32(s.msg.cascade_lens).tolist() == [200]
    assert s.cascade_saved == 3 * 200
    s = step(b, running, waiting)  # decode
    assert from_i32(s.msg.cascade_group).tolist() == [0, 0, 0, 0, -1]
    assert from_i32(s.msg.cascade_lens).tolist() == [200]
    assert b.counters.cascade_steps == 2 and b.counters.cascade_saved == 2 * 600
    finish_all(b, running)


def test_grouped_batches_put_the_members_first_group_by_group():
    """The worker's shared level then reads the members' queries in place (``Cascade.leading``)."""
    b = cascade_batcher(CascadePolicy(min_group=2, min_prefix=64, min_saved=0, min_saved_eager=0))
    other = list(range(2000, 2100))
    warm(b, SYSTEM + [1])
    warm(b, other + [1])
    running = []
    waiting = deque([req(list(range(5000, 5030)), rid="alone"), req(SYSTEM + [10, 11], rid="s0"),
                     req(other + [12], rid="o0"), req(SYSTEM + [13, 14], rid="s1"), req(other + [15], rid="o1")])
    for _ in range(2):  # prefill (partly cached), then decode
        s = step(b, running, waiting)
        assert from_i32(s.msg.cascade_group).tolist() == [0, 0, 1, 1, -1]
        assert [r.rid for r in s.reqs] in (["s0", "s1", "o0", "o1", "alone"], ["o0", "o1", "s0", "s1", "alone"])
        ids, ext = from_i32(s.msg.input_ids).tolist(), from_i32(s.msg.extend_lens).tolist()
        starts = from_i32(s.msg.prefix_lens).tolist()
        for r, a, n, start in zip(s.reqs, np.cumsum([0] + ext), ext, starts):  # each request's tokens with it
            assert ids[a:a + n] == r.tokens(start, start + n)
        assert from_i32(s.msg.rows).tolist() == [r.row for r in s.reqs]
    finish_all(b, running)


def test_deepest_prefix_with_enough_members_wins():
    """Branches of one prompt (n > 1) share more than the system prompt: they group on the prompt,
    the others on the system prompt."""
    b = cascade_batcher(CascadePolicy(min_group=2, min_prefix=64, min_saved=0, min_saved_eager=0))
    prompt = SYSTEM + list(range(3000, 3100))
    warm(b, prompt + [1])
    warm(b, SYSTEM + [2])
    running = []
    waiting = deque([req(prompt + [7], rid="n", index=i) for i in range(3)]
                    + [req(SYSTEM + [50 + i, 60 + i], rid=f"q{i}") for i in range(2)])
    step(b, running, waiting)
    s = step(b, running, waiting)
    groups = from_i32(s.msg.cascade_group).tolist()
    lens = from_i32(s.msg.cascade_lens).tolist()
    assert groups[:3] == [groups[0]] * 3 and groups[3:] == [groups[3]] * 2 and groups[0] != groups[3]
    assert lens[groups[0]] == 300 and lens[groups[3]] == 200
    finish_all(b, running)


def test_thresholds_and_disabled():
    prompts = [SYSTEM + [10 + i] for i in range(4)]
    # the step decodes one token each (200 of 201 prompt tokens cached), 4 requests: it would replay a graph
    # of 8 (min_saved applies) and runs eagerly without graphs (min_saved_eager applies); groups save 600 tokens
    for policy, expect in [(CascadePolicy(min_group=5, min_prefix=1, min_saved=0, min_saved_eager=0), False),
                           (CascadePolicy(min_group=2, min_prefix=201, min_saved=0, min_saved_eager=0), False),
                           (CascadePolicy(min_group=2, min_prefix=1, min_saved=601, min_saved_eager=0, graph_bs=8), False),
                           (CascadePolicy(min_group=2, min_prefix=1, min_saved=600, min_saved_eager=10**6, graph_bs=8),
                            True),
                           (CascadePolicy(min_group=2, min_prefix=1, min_saved=0, min_saved_eager=601, graph_bs=0), False),
                           (CascadePolicy(min_group=2, min_prefix=1, min_saved=10**6, min_saved_eager=600, graph_bs=3),
                            True),  # (4 requests: above the largest graph)
                           (None, False)]:
        b = cascade_batcher(policy) if policy else Batcher(KVManager(8192, 64), POLICIES["fcfs"](),
                                                           Limits(64, 4096, 4096))
        warm(b, SYSTEM + [1])
        running, waiting = [], deque(req(p, rid=f"q{i}") for i, p in enumerate(prompts))
        s = step(b, running, waiting)
        assert bool(s.msg.cascade_group) is expect, policy
        finish_all(b, running)


def test_a_duplicate_of_a_cached_prefix_is_not_grouped():
    """Two requests computed the same prompt side by side (no cache yet): the second keeps its own
    slots for it after inserting, so it shares no KV with requests that later match the tree."""
    b = cascade_batcher(CascadePolicy(min_group=2, min_prefix=64, min_saved=0, min_saved_eager=0))
    running = []
    a, dup = req(SYSTEM + [1], rid="a"), req(SYSTEM + [1], rid="dup")
    b.kv.admit(a), b.kv.admit(dup)
    for r in (a, dup):
        r.status = type(r.status).RUNNING
        b.kv.extend(r, len(r.prompt))
        running.append(r)
    b.kv.cache_prefix(a)
    b.kv.cache_prefix(dup)  # already cached: dup's slots stay its own
    assert dup.slots[:200] != a.slots[:200]
    later = req(SYSTEM + [5, 6], rid="later")
    b.kv.admit(later)
    later.status = type(later.status).RUNNING
    running.append(later)
    groups = plan_groups([a, dup, later], [201, 201, 200], b.cascade, b.kv.cache)
    assert groups is not None and groups.group[1] == -1 and groups.group[0] == groups.group[2] >= 0
    finish_all(b, running)


def test_no_cache_no_groups():
    b = Batcher(KVManager(8192, 64, enable_cache=False), POLICIES["fcfs"](), Limits(64, 4096, 4096),
                CascadePolicy(min_group=2, min_prefix=1, min_saved=0, min_saved_eager=0))
    running, waiting = [], deque(req(SYSTEM + [i]) for i in range(4))
    for _ in range(3):
        s = step(b, running, waiting)
        assert not s.msg.cascade_group
    finish_all(b, running)


# --- the FlashInfer backend's plans, against a PyTorch stand-in of FlashInfer ----------------------
# (the plain batches too: a mixed batch's decode rows and prefill chunks go through two plans)


@pytest.mark.parametrize("name,grouped", [(n, False) for n in CASES] + [(n, True) for n in GROUPED])
def test_flashinfer_backend_plans_on_a_stand_in(monkeypatch, name, grouped):
    """A mixed step's decodes and prompt chunks split between the decode and the prefill plan (in place or
    gathered; one plan for both measured slower: docs/decisions/0004)."""
    from tests import fake_flashinfer
    from services.worker.attention.flashinfer_backend import FlashInferAttention

    monkeypatch.setitem(sys.modules, "flashinfer", fake_flashinfer.module())
    pool, plain, cascaded, (q, k, v) = build(name, 8, 2, 16, torch.float32, "cpu")
    ref = TorchAttention(pool)
    ref.prepare(plain)
    want = ref.forward(q, k, v, 0)
    fi = FlashInferAttention(pool, 8)
    fi.prepare(cascaded if grouped else plain)
    assert fi.shared.plans == int(grouped)
    if name.startswith("mixed"):  # decodes and prefill chunks: split in two plans
        assert (fi.decode.plans, fi.paged.plans) == (1, 1)
    torch.testing.assert_close(fi.forward(q, k, v, 0), want, rtol=1e-5, atol=1e-5)
    wide = torch.zeros(q.shape[0], q.shape[1], 2 * q.shape[2])  # q a strided view (an eager step's, of q/k/v)
    wide[:, :, : q.shape[2]] = q
    torch.testing.assert_close(fi.forward(wide[:, :, : q.shape[2]], k, v, 0), want, rtol=1e-5, atol=1e-5)


def test_kv_indices_with_starts():
    from services.worker.attention.flashinfer_backend import kv_indices

    table = torch.arange(3 * 10, dtype=torch.int32).view(3, 10)
    got = kv_indices(table, torch.tensor([2, 0]), torch.tensor([3, 2]), 5, starts=torch.tensor([4, 7]))
    assert got.tolist() == [24, 25, 26, 7, 8]


def test_a_request_reading_a_duplicate_below_its_own_inserted_tail_is_not_grouped():
    """``dup`` computed SYSTEM + [1] beside ``a`` and inserted its own tail after ``a`` had cached
    the common part: the tree's path to dup's tail node is a's slots, then dup's. Requests matching
    that path share it; dup (its own duplicate slots below) does not."""
    b = cascade_batcher(CascadePolicy(min_group=2, min_prefix=64, min_saved=0, min_saved_eager=0))
    tail_a, tail_d = list(range(7000, 7040)), list(range(8000, 8040))
    a, dup = req(SYSTEM + [1] + tail_a + [2], rid="a"), req(SYSTEM + [1] + tail_d + [2], rid="dup")
    running = []
    for r in (a, dup):
        b.kv.admit(r)
        r.status = type(r.status).RUNNING
        b.kv.extend(r, len(r.prompt))
        running.append(r)
    b.kv.cache_prefix(a)
    b.kv.cache_prefix(dup)
    assert dup.lock_node.depth == 242 and dup.slots[241] == dup.lock_node.value[-1]  # its tail is the tree's
    assert dup.slots[:201] != a.slots[:201]  # ... below it, its own duplicates
    later = [req(SYSTEM + [1] + tail_d + [2, 3 + i], rid=f"l{i}") for i in range(2)]
    for r in later:
        b.kv.admit(r)
        r.status = type(r.status).RUNNING
        running.append(r)
    assert all(len(r.slots) == 242 for r in later)
    groups = plan_groups([dup, *later], [242, 242, 242], b.cascade, b.kv.cache)
    assert groups is not None and groups.group == [-1, 0, 0] and groups.lens == [242]
    finish_all(b, running)
