"""What the scheduler adds to a batch before sending it, and reads back from a step's output:
grammar bitmasks and scoring positions (prompt log-probs: the prompt chunks' positions from the
request's ``first_scored`` - 1 on, until they were sent) down; logprobs and prompt logprobs up."""

from __future__ import annotations

import time

import msgspec

from shared.messages.common import from_f32, from_i32, i32
from shared.messages.to_scheduler import StepOutput
from shared.messages.to_worker import ForwardBatch, StepMask
from services.scheduler.batcher import Scheduled
from services.scheduler.grammar import GrammarBackend
from services.scheduler.request import Req, Status


class StepLogprobs:
    """Logprob arrays of one StepOutput, decoded only if some request asked for them."""

    def __init__(self, out: StepOutput) -> None:
        self.lp = from_f32(out.logprobs) if out.logprobs else None
        k = out.top_k
        self.top_ids = from_i32(out.top_ids).reshape(-1, k) if k else None
        self.top_lp = from_f32(out.top_logprobs).reshape(-1, k) if k else None

    def take(self, i: int, r: Req) -> None:
        if self.lp is None:
            return
        r.unsent_logprobs.append(float(self.lp[i]))
        n = r.params.top_logprobs
        if n and self.top_ids is not None:
            r.unsent_top_ids.append(self.top_ids[i, :n].tolist())
            r.unsent_top_logprobs.append(self.top_lp[i, :n].tolist())


def _mask_rows(sched: Scheduled) -> list[int]:
    return [i for i, (r, s) in enumerate(zip(sched.reqs, sched.emits)) if s and r.matcher is not None]


def with_extras(sched: Scheduled, grammar: GrammarBackend | None, defer_mask: bool = False,
                follows: bool = False) -> ForwardBatch:
    """Attach what only some steps need: the allowed-token bitmask of every constrained request
    that samples (or, with ``defer_mask``, only which rows get one: ``deferred_mask`` sends it once
    the step in flight has advanced the matchers), and the positions whose logprobs scoring
    requests want."""
    extra: dict = {"follows": True} if follows else {}
    rows = _mask_rows(sched)
    if rows and defer_mask:
        extra.update(mask_rows=i32(rows), mask_deferred=True)
    elif rows:
        t0 = time.perf_counter()
        mask = grammar.bitmask([sched.reqs[i].matcher for i in rows])
        extra.update(mask_rows=i32(rows), bitmask=mask.tobytes(), mask_fill_ms=(time.perf_counter() - t0) * 1e3)
    score = [(i, r) for i, r in enumerate(sched.reqs) if r.scoring]
    if score:
        starts = from_i32(sched.msg.prefix_lens)
        rows, first, nxt = [], [], []
        for i, r in score:
            start = int(starts[i])
            end = start + sched.extend[i]  # positions start .. end-1 are computed now
            want = max(r.params.first_scored - 1, r.prompt_lp_next)  # the first position whose logits are wanted
            if start < len(r.prompt) and end - 1 >= want:  # (prompt chunks only: not a decode's own row)
                rows.append(i)
                first.append(max(want, start))
                nxt.append(r.tokens(end, end + 1)[0] if end < len(r.prompt) else -1)
                r.prompt_lp_next = end  # (a retraction keeps what was scored: resuming, it is not asked again)
        if rows:
            extra.update(score_rows=i32(rows), score_from=i32(first), score_next=i32(nxt))
    return msgspec.structs.replace(sched.msg, **extra) if extra else sched.msg


def deferred_mask(sched: Scheduled, grammar: GrammarBackend) -> StepMask:
    """The bitmask ``with_extras`` deferred, from the matchers as they are now. Rows whose sample
    will be dropped (finished, or replaced by jump-forward) allow every token."""
    t0 = time.perf_counter()
    reqs = [sched.reqs[i] for i in _mask_rows(sched)]
    live = [k for k, r in enumerate(reqs) if r.status is Status.RUNNING and not r.discard]
    mask = grammar.bitmask([reqs[k].matcher for k in live], live, len(reqs))
    return StepMask(step_id=sched.step_id, bitmask=mask.tobytes(), fill_ms=(time.perf_counter() - t0) * 1e3)


def take_prompt_logprobs(sched: Scheduled, out: StepOutput) -> None:
    """The scored positions' logprobs (and alternatives, as many as each request asked for) into
    their requests."""
    if not out.prompt_logprob_counts:
        return
    values = from_f32(out.prompt_logprobs).tolist()
    k = out.prompt_top_k
    top_ids = from_i32(out.prompt_top_ids).reshape(-1, k) if k else None
    top_lp = from_f32(out.prompt_top_logprobs).reshape(-1, k) if k else None
    rows = from_i32(sched.msg.score_rows).tolist()
    pos = 0
    for i, n in zip(rows, from_i32(out.prompt_logprob_counts).tolist()):
        r = sched.reqs[i]
        r.prompt_logprobs.extend(values[pos:pos + n])
        want = r.params.prompt_top_logprobs
        if want and top_ids is not None:
            r.prompt_top_ids.extend(top_ids[pos:pos + n, :want].tolist())
            r.prompt_top_logprobs.extend(top_lp[pos:pos + n, :want].tolist())
        pos += n
