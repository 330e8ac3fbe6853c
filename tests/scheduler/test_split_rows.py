"""Jump-forward chunks sent as one-token rows (``Plan.split_output_chunks``): the step becomes a
pure decode the worker replays from a CUDA graph; when it would not (a prompt chunk in the step,
too many rows for the largest graph, a long chunk) the chunk goes as it is."""

from __future__ import annotations

from collections import deque

from services.scheduler.batcher import Batcher, Limits
from services.scheduler.plan import SPLIT_MAX_TOKENS
from services.scheduler.kv import KVManager
from services.scheduler.policy import POLICIES
from shared.messages.common import from_i32
from tests.scheduler.test_scheduler_units import apply, req, step


def batcher(graph_bs: int) -> Batcher:
    return Batcher(KVManager(4096, 64), POLICIES["fcfs"](), Limits(64, 4096, 4096, graph_bs=graph_bs))


def started(b: Batcher, prompts: list[range]) -> list:
    """Requests past their prefill, one output token each (5)."""
    running, waiting = [], deque(req(p, max_new=64, rid=f"r{i}") for i, p in enumerate(prompts))
    step(b, running, waiting)
    return running


def fields(s) -> tuple[list[int], list[int], list[int], list[bool], list[int]]:
    m = s.msg
    return (from_i32(m.rows).tolist(), from_i32(m.prefix_lens).tolist(), from_i32(m.extend_lens).tolist(),
            list(s.emits), from_i32(m.input_ids).tolist())


def test_forced_tokens_go_as_rows_of_one_request_at_consecutive_positions() -> None:
    b = batcher(graph_bs=16)
    running = started(b, [range(10, 30), range(40, 50)])
    a, other = running
    a.output += [7, 8, 9]  # jump-forward appended three forced tokens after the sampled 5
    s = b.build(running, deque())
    rows, prefix, extend, emits, ids = fields(s)
    assert rows == [other.row] + [a.row] * 4 and extend == [1] * 5
    assert prefix == [10, 20, 21, 22, 23] and emits == [True, False, False, False, True]
    assert ids == [5, 5, 7, 8, 9] and from_i32(s.msg.out_slots).tolist() == other.slots[-1:] + a.slots[-4:]
    assert s.reqs == [other, a, a, a, a] and s.prefill_tokens == 4 and a.pending == 1
    apply(b, s, running)
    assert a.output == [5, 7, 8, 9, 5] and a.num_computed == 24  # one token sampled, after the last row
    s = b.build(running, deque())  # then plain decodes
    assert fields(s)[2] == [1, 1] and sorted(fields(s)[1]) == [11, 24]


def test_chunks_stay_whole_when_the_step_would_not_replay_a_graph() -> None:
    b = batcher(graph_bs=0)  # no graphs (CPU)
    running = started(b, [range(10, 30)])
    running[0].output += [7, 8, 9]
    assert fields(b.build(running, deque()))[2] == [4]

    b = batcher(graph_bs=4)  # 1 decode + 4 rows > 4
    running = started(b, [range(10, 30), range(40, 50)])
    running[0].output += [7, 8, 9]
    assert fields(b.build(running, deque()))[2] == [1, 4]

    b = batcher(graph_bs=64)  # a chunk longer than the cap
    running = started(b, [range(10, 30)])
    running[0].output += list(range(100, 100 + SPLIT_MAX_TOKENS))
    assert fields(b.build(running, deque()))[2] == [SPLIT_MAX_TOKENS + 1]

    b = batcher(graph_bs=64)  # a prompt arrives in the same step: it runs eagerly anyway
    running = started(b, [range(10, 30)])
    running[0].output += [7, 8]
    s = b.build(running, deque([req(range(60, 90), rid="late")]))
    assert sorted(fields(s)[2]) == [3, 30]
