"""Shared-prefix (cascade) attention groups for one batch.

When many requests in a step read the same cached prefix (a system prompt, a document, the prompt
of n > 1 branches), the worker can read that prefix's KV once for the whole group and merge the
partial attention states (log-sum-exp) with each request's own suffix, instead of reading it once
per request. The scheduler decides the groups, because it owns the radix tree: a request's cached
prefix is the path from the root to its locked node, so requests under the same node share the KV
slots of that whole path.

Each request joins the deepest node on its path that at least ``min_group`` requests of the batch
pass through (a longer shared prefix, a smaller group). A request joins only if its KV really is
the tree's from the root to that node: a request that computed a duplicate of a prefix someone
else cached first keeps its own slots for it (even when the tail it inserted after it is the
tree's). A node's slots come from one insert and a request's slots inside one node are either all
the node's or none (the tree splits at every boundary between the two), so comparing the last
slot of each node on the path is exact. Groups are sent only when they save enough: sum over
groups of (members - 1) × prefix length, in tokens of KV not read.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from services.scheduler.cache import CacheHandle, PrefixCache
from services.scheduler.request import Req


@dataclass(frozen=True)
class CascadePolicy:
    """When groups pay. A grouped step always runs eagerly: when the same step without groups would
    replay a CUDA graph (a pure decode of at most ``graph_bs`` requests), the groups must save at
    least ``min_saved`` KV tokens (what running eagerly costs, in KV tokens read: measured on the H200,
    docs/architecture.md); when it would run eagerly anyway (prefill chunks in it, or
    a batch above the largest graph), ``min_saved_eager`` (the merge pass and the second plan)."""

    min_group: int = 4  # requests reading one prefix before it is read once for all
    min_prefix: int = 640  # shortest shared prefix worth a group (tokens)
    min_saved: int = 131072  # KV tokens a step that could replay a graph must save
    min_saved_eager: int = 32768  # KV tokens an eager step must save
    graph_bs: int = 0  # the worker's largest CUDA-graph batch (0: none)


@dataclass(frozen=True)
class Groups:
    group: list[int]  # per request in batch order: its group, -1 for none
    lens: list[int]  # per group: the shared prefix length in tokens
    saved: int  # KV tokens not read this step thanks to the groups


def _path(cache: PrefixCache, r: Req, start: int) -> list[CacheHandle]:
    """The nodes of ``r``'s locked path whose KV it reads, deepest first: from the root down, up
    to the first node whose last slot is not ``r``'s slot at that position, or that ends beyond the
    KV computed before this step (``start`` tokens)."""
    slots, out = r.slots, []
    for node in cache.path(r.lock_node):
        d = node.depth
        if d > start or d > len(slots) or slots[d - 1] != node.last_slot:
            break
        out.append(node)
    out.reverse()
    return out


def plan_groups(reqs: list[Req], starts: list[int], policy: CascadePolicy, cache: PrefixCache,
                decode: bool = True) -> Groups | None:
    """The groups of a batch (``starts``: each request's tokens in KV before the step; ``decode``:
    every request computes one token), or None when they would not save enough (the policy)."""
    if len(reqs) < policy.min_group:
        return None
    lo = policy.min_prefix
    paths = [[n for n in _path(cache, r, s) if n.depth >= lo] if r.lock_node is not None else []
             for r, s in zip(reqs, starts, strict=True)]
    count: Counter = Counter(id(node) for p in paths for node in p)
    if not count or max(count.values()) < policy.min_group:
        return None
    chosen: list[tuple[int, int] | None] = []  # per request: (node id, depth)
    for p in paths:
        pick = next(((id(n), n.depth) for n in p if count[id(n)] >= policy.min_group), None)  # deepest first
        chosen.append(pick)
    members = Counter(c for c in chosen if c is not None)
    index: dict[tuple[int, int], int] = {}
    group, lens, saved = [], [], 0
    for c in chosen:
        if c is None or members[c] < 2:  # alone under its node (the others went deeper)
            group.append(-1)
            continue
        if c not in index:
            index[c] = len(lens)
            lens.append(c[1])
            saved += (members[c] - 1) * c[1]
        group.append(index[c])
    graph = decode and len(reqs) <= policy.graph_bs
    if saved < (policy.min_saved if graph else policy.min_saved_eager):
        return None
    return Groups(group, lens, saved)
