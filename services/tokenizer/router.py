"""Data-parallel routing: which scheduler group (of ``--dp N``) gets a request.

Each group has its own KV pool and radix cache, so a request should go where its prompt's prefix
is probably cached (prefix affinity), unless that group is far busier than another (load).

**Approximate prefix tree.** The router remembers the prompts it routed, cut into page-aligned
blocks of ``block_tokens`` token ids. A block is named by a chained hash — the hash of the cache
namespace, the block and every block before it — so one 64-bit number stands for a whole prefix,
and a prompt's block hashes form its path in a hashed prefix tree. Per group there is an LRU of
the block hashes sent there, bounded by the group's KV pool (``pool_tokens / block_tokens``
blocks: a group cannot hold more prefix than that, so older entries are probably evicted there
too) and by ``max_blocks``; a map hash → bitmask of groups answers "who has this prefix". A
prompt's blocks are recorded deepest first, so a prefix stays longer than its extensions, as
leaves go first in the radix tree.

**Choice** (``route``):

1. *match*: walk the prompt's block hashes from the first; a group's match is how many leading
   blocks it holds.
2. *candidates*: the groups that are up and not far above the least-loaded one: a group is far
   above when its load exceeds the least load by more than ``balance_abs`` *and* by more than a
   factor ``balance_rel``. The least-loaded group is always a candidate.
3. *pick*: the candidate with the longest match; ties go to the least loaded, then to the
   rendezvous order. For a prefix no candidate holds: the rendezvous (highest random weight) hash
   of the prompt's first block (of the whole prompt when shorter than a block). That order is a
   pure function of the prompt, so tokenizer replicas routing independently send a new prefix to
   the same group, and requests sharing a first block land together before any replica has seen
   them.

**Load** is counted in branches (an ``n = 4`` request is 4): those this replica has in flight on
the group, plus — when the client probes the schedulers with ``LoadReq`` — the other replicas'
share of the scheduler's running + waiting count at the last probe.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class Route:
    """Where a request goes. ``reason``: ``prefix`` (the longest cached prefix), ``hash`` (a prefix
    no group holds: rendezvous order), ``load`` (the preferred group was far busier than another),
    ``only`` (one group up)."""

    group: int
    matched_tokens: int  # prompt tokens the chosen group probably has cached (block-aligned)
    reason: str


def block_hashes(ids: list[int], ns: str, block_tokens: int) -> list[int]:
    """Chained 64-bit hashes of the full ``block_tokens`` blocks of ``ids`` in namespace ``ns``.
    CPython's hash of a tuple of ints is not salted (PYTHONHASHSEED salts only str and bytes), so
    every process of one build computes the same; it is ~4× faster than blake2b per block, and a
    collision costs at worst a cache miss."""
    h = int.from_bytes(hashlib.blake2b(ns.encode(), digest_size=8).digest(), "little", signed=True)
    out = []
    for i in range(0, len(ids) - block_tokens + 1, block_tokens):
        h = hash((h, *ids[i:i + block_tokens]))
        out.append(h)
    return out


def rendezvous(key: int, groups: list[int]) -> list[int]:
    """``groups`` in highest-random-weight order for ``key`` (the same in every process)."""
    kb = key.to_bytes(8, "little", signed=True)
    return sorted(groups, key=lambda g: hashlib.blake2b(kb + g.to_bytes(4, "little"), digest_size=8).digest(),
                  reverse=True)


class _Group:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.lru: OrderedDict[int, None] = OrderedDict()  # block hashes sent here, oldest first
        self.in_flight = 0  # branches this replica has in flight here
        self.others = 0  # the other replicas' branches here, at the last load probe
        self.up = True

    @property
    def load(self) -> int:
        return self.in_flight + self.others


class Router:
    def __init__(self, num_groups: int, block_tokens: int = 32, max_blocks: int = 1 << 18,
                 balance_abs: int = 32, balance_rel: float = 1.5) -> None:
        assert num_groups >= 1 and block_tokens >= 1 and max_blocks >= 1 and balance_abs >= 0 and balance_rel >= 1
        self.block_tokens, self.max_blocks = block_tokens, max_blocks
        self.balance_abs, self.balance_rel = balance_abs, balance_rel
        self.groups = [_Group(max_blocks) for _ in range(num_groups)]
        self._where: dict[int, int] = {}  # block hash → bitmask of the groups that hold it

    # ---- what the client tells the router ---------------------------------------------------
    def set_pool(self, g: int, pool_tokens: int) -> None:
        """Group ``g``'s KV pool size: bounds what the router remembers for it."""
        grp = self.groups[g]
        grp.capacity = max(1, min(self.max_blocks, pool_tokens // self.block_tokens))
        self._trim(g)

    def started(self, g: int, branches: int) -> None:
        self.groups[g].in_flight += branches

    def ended(self, g: int, branches: int) -> None:
        self.groups[g].in_flight -= branches
        assert self.groups[g].in_flight >= 0

    def observed(self, g: int, scheduler_load: int, mine_at_probe: int) -> None:
        """A load probe answered: the scheduler counts ``scheduler_load`` branches (running +
        waiting), of which about ``mine_at_probe`` (this replica's in flight when it asked) are ours."""
        self.groups[g].others = max(0, scheduler_load - mine_at_probe)

    def set_up(self, g: int, up: bool) -> None:
        """A group that stops answering is routed around; its remembered prefixes are forgotten
        (if it comes back, it may have restarted with an empty cache)."""
        grp = self.groups[g]
        grp.up = up
        if not up:
            for h in grp.lru:
                self._drop(h, g)
            grp.lru.clear()
            grp.others = 0

    def loads(self) -> list[int]:
        return [grp.load for grp in self.groups]

    # ---- the decision ------------------------------------------------------------------------
    def matches(self, hashes: list[int]) -> list[int]:
        """Per group: how many leading blocks of the prompt (given as ``block_hashes``) it holds."""
        n = len(self.groups)
        depth = [0] * n
        alive = (1 << n) - 1  # the groups holding every block so far
        for i, h in enumerate(hashes):
            held = alive & self._where.get(h, 0)
            if held != alive:
                for g in range(n):
                    if (alive & ~held) >> g & 1:
                        depth[g] = i
                alive = held
                if not alive:
                    return depth
        for g in range(n):
            if alive >> g & 1:
                depth[g] = len(hashes)
        return depth

    def route(self, ids: list[int], ns: str = "") -> Route:
        """Choose a group for a prompt and remember that its prefix goes there. Raises
        ``LookupError`` when no group is up."""
        up = [g for g, grp in enumerate(self.groups) if grp.up]
        if not up:
            raise LookupError("no data-parallel group is up")
        if len(self.groups) == 1:
            return Route(0, 0, "only")  # nothing to choose: remember nothing
        hashes = block_hashes(ids, ns, self.block_tokens)
        depth = self.matches(hashes)
        loads = self.loads()
        least = min(loads[g] for g in up)
        candidates = [g for g in up if not self._far_above(loads[g], least)]
        key = hashes[0] if hashes else (block_hashes(ids, ns, len(ids))[0] if ids else 0)  # short: all of it
        order = {g: i for i, g in enumerate(rendezvous(key, up))}
        best = max(candidates, key=lambda g: (depth[g], -loads[g] if depth[g] else 0, -order[g]))
        # what it would have been without the load guard: is the choice a load decision?
        preferred = max(up, key=lambda g: (depth[g], -loads[g] if depth[g] else 0, -order[g]))
        if len(up) == 1:
            reason = "only"
        elif best != preferred:
            reason = "load"
        else:
            reason = "prefix" if depth[best] else "hash"
        self._record(best, hashes)
        return Route(best, depth[best] * self.block_tokens, reason)

    def _far_above(self, load: int, least: int) -> bool:
        return load - least > self.balance_abs and load > least * self.balance_rel

    # ---- the approximate tree ----------------------------------------------------------------
    def _record(self, g: int, hashes: list[int]) -> None:
        grp, bit = self.groups[g], 1 << g
        for h in reversed(hashes):  # deepest first: the prefix ends up most recently used
            grp.lru[h] = None
            grp.lru.move_to_end(h)
            self._where[h] = self._where.get(h, 0) | bit
        self._trim(g)

    def _trim(self, g: int) -> None:
        grp = self.groups[g]
        while len(grp.lru) > grp.capacity:
            h, _ = grp.lru.popitem(last=False)
            self._drop(h, g)

    def _drop(self, h: int, g: int) -> None:
        m = self._where.get(h, 0) & ~(1 << g)
        if m:
            self._where[h] = m
        else:
            self._where.pop(h, None)

    def blocks(self, g: int) -> int:
        """Block hashes remembered for group ``g``."""
        return len(self.groups[g].lru)
