"""The worker's logit processors on CUDA give the CPU's results, and queue their work without
synchronizing with the device (CUDA's sync debug mode raises on any synchronization)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shared.messages.common import SamplingParams, i32
from shared.messages.to_worker import NewReq
from services.worker.sampling.processors import LogitProcessors

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
V = 50


def new_req(row: int, prompt: list[int], **params) -> NewReq:
    return NewReq(rid=f"r{row}", row=row, params=SamplingParams(stop_token_ids=[3, 7], **params),
                  prompt_len=len(prompt), prompt_ids=i32(prompt))


def test_processors_on_cuda_match_the_cpu_without_syncing():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, V, generator=g)
    reqs = [new_req(0, [1, 2, 3], repetition_penalty=1.5, logit_bias={4: 2.0}), new_req(1, [9], min_new_tokens=4)]
    out = []
    for dev in ("cpu", "cuda"):
        procs = LogitProcessors(V, torch.device(dev))
        for nr in reqs:
            procs.add_row(nr)
        x = logits.to(dev)
        if dev == "cuda":
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            procs.apply(x, [0, 1], [nr.params for nr in reqs], np.array([3, 1]))
            procs.record([0, 1], x.argmax(dim=-1))
        finally:
            torch.cuda.set_sync_debug_mode("default")
        out.append(x.cpu())
    assert torch.allclose(out[0], out[1], atol=1e-6)
