"""What a step is (``step_kind``) and a step queued on the device, not yet finished (``Launched``): the runner's
record between ``launch``, ``sample`` and ``finish``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from shared.messages.to_worker import ForwardBatch
from services.worker.hostio import HostCopy
from services.worker.sampling.batch import Sampled


def step_kind(extend: np.ndarray, graph: bool, pieces: bool = False) -> str:
    """What a step is, for the per-kind step metrics: decodes only (one new token a row), replayed
    from a CUDA graph or run eagerly; prompt chunks only; or both in one step — ``_piecewise`` when
    its work between attentions replays piecewise graphs."""
    decode = extend == 1
    if decode.all() and (graph or not pieces):
        return "decode_graph" if graph else "decode_eager"
    kind = "decode" if decode.all() else "mixed" if decode.any() else "prefill"
    return kind + "_piecewise" if pieces else kind


@dataclass(eq=False)
class Launched:
    """A step queued on the device (``ModelRunner.launch``), not yet finished."""

    batch: ForwardBatch
    emits: np.ndarray  # (B,) bool: the step emits this row's next token
    start: Any  # DeviceTimer marks
    logits: torch.Tensor | None  # until sampled
    scores: dict  # prompt-logprob tensors of scoring requests
    sampled: Sampled | None = None
    host: HostCopy | None = None
    end: Any = None
    awaits_mask: bool = False
    kind: str = ""  # decode_graph / decode_eager / mixed / prefill, [decode_, mixed_, prefill_]piecewise
    rows_d: torch.Tensor | None = None  # the batch's rows on the device (in batch order)

    def __post_init__(self) -> None:
        b = self.batch
        self.awaits_mask = bool(b.mask_deferred and b.mask_rows and self.emits.any())

    def ready(self) -> bool:
        """Its results reached the host (``finish`` will not wait)."""
        return not self.awaits_mask and (self.host is None or self.host.ready())
