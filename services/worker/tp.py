"""Tensor parallelism across worker processes: process-group set-up, and the relay through which
rank 0 hands every scheduler message to the other ranks.

Every rank runs the same steps (the sharded layers all-reduce inside them); only rank 0 talks to
the scheduler and samples. The relay sends each message as the worker channel's own codec bytes
(msgpack, never pickle) in a uint8 tensor, its length first, over a gloo group.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from shared.config import WorkerConfig
from shared.messages.codec import Codec
from shared.messages.to_worker import ToWorker

HEARTBEAT_S = 60.0  # an idle rank 0 still broadcasts this often, well inside the group timeout
TIMEOUT = timedelta(minutes=30)


@dataclass(frozen=True)
class TPGroup:
    """This process's place in its tensor-parallel group (``group`` None: the default group)."""

    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's ``x`` along the last dim, in rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


class Relay:
    """Rank 0 → all ranks, one message at a time; a zero length is a heartbeat."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.codec: Codec = Codec(ToWorker)
        self._last = time.monotonic()

    def send(self, msg: ToWorker) -> None:
        self._send(self.codec.encode(msg))

    def heartbeat(self) -> None:
        """Call when idle: keeps the other ranks' blocking receive inside the group timeout."""
        if time.monotonic() - self._last > HEARTBEAT_S:
            self._send(b"")

    def recv(self) -> ToWorker | None:
        """Block for rank 0's next message (None: a heartbeat)."""
        length = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(length, src=0, group=self.group)
        if not length.item():
            return None
        data = torch.empty(int(length.item()), dtype=torch.uint8)
        dist.broadcast(data, src=0, group=self.group)
        return self.codec.decode(data.numpy().tobytes())

    def _send(self, data: bytes) -> None:
        dist.broadcast(torch.tensor([len(data)], dtype=torch.int64), src=0, group=self.group)
        if data:
            dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), src=0, group=self.group)
        self._last = time.monotonic()


def init_tp(cfg: WorkerConfig, cuda: bool) -> tuple[TPGroup, Relay | None]:
    """Join the tensor-parallel group: NCCL for the model's collectives on GPUs (plus a gloo group
    for the relay), gloo for everything on CPUs. Single rank: no group, no relay."""
    if cfg.tp_size == 1:
        return TPGroup(), None
    if cuda:
        torch.cuda.set_device(cfg.tp_rank % torch.cuda.device_count())
    else:  # the ranks share the host's cores
        torch.set_num_threads(max(1, torch.get_num_threads() // cfg.tp_size))
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://{cfg.dist_init_addr}",
                            rank=cfg.tp_rank, world_size=cfg.tp_size, timeout=TIMEOUT)
    control = dist.new_group(backend="gloo", timeout=TIMEOUT) if cuda else None
    return TPGroup(cfg.tp_rank, cfg.tp_size), Relay(control)
