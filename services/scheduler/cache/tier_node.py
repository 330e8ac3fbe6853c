"""What the tiered tree (tiers.py) is made of: its nodes (a radix node plus where else its KV is),
disk file records, and the records of copies in flight."""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.messages.to_worker import CopyKind
from services.scheduler.cache.radix import Node

# per kind of copy: what an op in flight adds to its nodes' (host, disk) busy counts; which lock their node
BUSY = {CopyKind.BACKUP: (1, 0), CopyKind.DEMOTE: (1, 0), CopyKind.LOAD: (1, 0), CopyKind.DISK_WRITE: (1, 1),
        CopyKind.DISK_READ: (1, 1)}
LOCKS = (CopyKind.BACKUP, CopyKind.LOAD)


class TierNode(Node):
    __slots__ = ("host", "host_ready", "disk", "disk_ready", "incoming", "host_busy", "disk_busy", "fill_op",
                 "pool_children")

    def __init__(self, key: list[int], value: list[int], parent: Node | None, tick: int = 0) -> None:
        super().__init__(key, value, parent, tick)
        self.host: list[int] | None = None
        self.host_ready = False
        self.disk: tuple[int, int] | None = None
        self.disk_ready = False
        self.incoming: list[int] | None = None
        self.host_busy = 0
        self.disk_busy = 0
        self.fill_op = 0  # the disk read that filled the host copy (a load waits for it on every rank)
        self.pool_children = 0  # children in the pool (none: a device leaf, when itself in the pool)

    @property
    def hole(self) -> bool:
        return not self.value and self.incoming is None and self.host is None and self.disk is None


@dataclass
class FileRec:
    nbytes: int
    nodes: set = field(default_factory=set)  # nodes whose disk copy is (part of) this file


@dataclass(eq=False)
class Op:
    op_id: int
    kind: CopyKind
    node: TierNode  # the lowest node of the segment
    top: int  # the segment: nodes below this depth, up to ``node``
    tokens: int
    file: int = -1
