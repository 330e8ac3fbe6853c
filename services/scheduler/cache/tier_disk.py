"""The disk tier's side of the tiered tree (a mixin of ``TieredRadixCache``, tiers.py): the files'
budget and references, LRU eviction of disk copies, and hanging the files an earlier run left back
into the tree after a restart. A file holds one node's KV as it was when written; nodes split later
refer to parts of it (``disk`` = file, offset), and it goes when no node refers to it."""

from __future__ import annotations

import heapq

from services.scheduler.cache.radix import common_len
from services.scheduler.cache.tier_node import FileRec, TierNode


class DiskTier:
    """Uses the tree's ``files``, ``disk_used``, ``disk_capacity``, ``_on_disk``, ``bytes_per_token``
    (set by ``TieredRadixCache.__init__``) and the copies of ``TierOps``."""

    def file_bytes(self, tokens: int, depth: int) -> int:
        """A file's size: its payload, the token ids of its path and a header."""
        return tokens * self.bytes_per_token + 4 * depth + 512

    def make_room_on_disk(self, nbytes: int) -> bool:
        if self.disk_used + nbytes > self.disk_capacity:  # (a 64th of the budget at least, as on the host)
            self.evict_disk(max(self.disk_used + nbytes - self.disk_capacity, self.disk_capacity // 64))
        return self.disk_used + nbytes <= self.disk_capacity

    def add_file(self, node: TierNode, file: int, offset: int, nbytes: int, ready: bool) -> None:
        rec = self.files.get(file)
        if rec is None:
            rec = self.files[file] = FileRec(nbytes)
            self.disk_used += nbytes
        rec.nodes.add(node)
        node.disk, node.disk_ready = (file, offset), ready
        self._on_disk.add(node)

    def drop_disk(self, node: TierNode) -> None:
        f = node.disk[0]
        node.disk, node.disk_ready = None, False
        self._on_disk.discard(node)
        rec = self.files[f]
        rec.nodes.discard(node)
        if not rec.nodes:
            self.forget_file(f)

    def forget_file(self, f: int) -> None:
        """No node refers to file ``f`` any more, or it is bad: out of the budget and deleted; nodes
        that still referred to it lose their disk copy."""
        rec = self.files.pop(f)
        self.disk_used -= rec.nbytes
        for n in rec.nodes:
            n.disk, n.disk_ready = None, False
            self._on_disk.discard(n)
        self.delete_file(f)
        for n in rec.nodes:
            self.prune(n)

    @staticmethod
    def _disk_droppable(n: TierNode) -> bool:
        return n.disk_ready and not n.disk_busy and not (n.lock_ref and not n.value and n.host is None)

    def evict_disk(self, nbytes: int) -> int:
        heap = [(n.last_access, -n.depth, n) for n in self._on_disk if self._disk_droppable(n)]
        heapq.heapify(heap)
        before = self.disk_used
        while before - self.disk_used < nbytes and heap:
            node = heapq.heappop(heap)[2]
            if node.disk is None or not self._disk_droppable(node):
                continue
            self.drop_disk(node)
            self.prune(node)
        return before - self.disk_used

    # ---- what the disk held before a restart -----------------------------------------------
    def restore(self, ns: str, tokens: list[int], start: int, file: int, nbytes: int) -> bool:
        """Hang file ``file`` (the KV of ``tokens[start:]``) under the nodes holding ``tokens[:start]``,
        as far as it is not in the tree already. False: unusable (its prefix is missing, it is not
        page-aligned, or it adds nothing) — the caller deletes it."""
        end = len(tokens)
        if start % self.page_size or end % self.page_size or end <= start:
            return False
        node: TierNode = self._root(ns)
        pos = 0
        while pos < end:
            child = node.children.get(self._edge(tokens, pos))
            if child is None:
                break
            n = self._aligned(common_len(child.key, tokens, pos))
            if n < len(child.key):
                if not start <= pos + n < end:  # (its prefix is not there, or it adds nothing: no split)
                    pos += n
                    break
                child = self._split(child, n)
            node, pos = child, pos + n
        if pos < start or pos >= end or not self.make_room_on_disk(nbytes):
            if not node.children and node.parent is None:
                self._drop_empty_root(node)
            return False
        leaf = self.node_type(tokens[pos:end], [], node, 0)
        node.children[self._edge(leaf.key, 0)] = leaf
        self.add_file(leaf, file, pos - start, nbytes, True)
        if self.listener is not None:
            self.listener.stored(ns, tokens, pos, end)
        return True
