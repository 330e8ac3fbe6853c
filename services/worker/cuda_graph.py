"""CUDA graphs of the pure-decode step (model forward + logits) for a set of batch sizes.

A decode batch of B requests replays the graph of the smallest captured size bs >= B. The graphs
read fixed device buffers; the runner fills them each step, padding rows B..bs-1 with token 0 at
position 0 of the table's padding row, writing their K/V to slot 0 (never allocated). Attention
metadata is planned outside the graph (``AttentionBackend.prepare_graph``) into fixed buffers too.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from services.worker.attention.base import AttentionBackend, AttentionBatch
from services.worker.models import CausalLM

# rows of the fixed int64 input buffer, in the order the runner packs a step's host arrays
IDS, OUT_SLOTS, POSITIONS, ROWS, PREFIX_LENS = range(5)
NUM_INPUTS = 5


def graph_batch_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, 8, every multiple of 8 up to 256, of 32 above (a padded row costs less there than
    another graph's capture), and ``max_bs`` itself."""
    sizes = [s for s in (1, 2, 4) if s < max_bs] + list(range(8, min(max_bs, 256) + 1, 8)) + \
        list(range(288, max_bs + 1, 32))
    return sorted(set(sizes) | {max_bs})


class DecodeGraphs:
    def __init__(self, model: CausalLM, attn: AttentionBackend, max_bs: int, max_context: int,
                 device: torch.device, vocab_size: int) -> None:
        self.model, self.attn = model, attn
        self.batch_sizes = graph_batch_sizes(max_bs)
        self.max_bs = self.batch_sizes[-1]
        self.inputs = torch.zeros((NUM_INPUTS, self.max_bs), dtype=torch.int64, device=device)
        self._extend = torch.ones(self.max_bs, dtype=torch.int64, device=device)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # one output for every graph: graph bs writes rows :bs (per-graph outputs would hold
        # sum(sizes) x V floats, gigabytes with a 128k vocabulary at max_bs 512)
        self.logits = torch.empty((self.max_bs, vocab_size), dtype=torch.float32, device=device)
        attn.init_graph(self.batch_sizes, max_context)
        self._capture(torch.zeros((1, max_context), dtype=torch.int32, device=device))

    def size_for(self, num_reqs: int) -> int | None:
        """The captured batch size a decode batch of ``num_reqs`` requests replays (None: eager)."""
        if num_reqs > self.max_bs:
            return None
        return next(bs for bs in self.batch_sizes if bs >= num_reqs)

    def batch(self, req_to_token: torch.Tensor, bs: int, prefix_lens: list[int]) -> AttentionBatch:
        """The attention view of the fixed buffers for a (padded) batch of ``bs`` rows."""
        x = self.inputs[:, :bs]
        return AttentionBatch(req_to_token=req_to_token, rows=x[ROWS], prefix_lens=x[PREFIX_LENS],
                              extend_lens=self._extend[:bs], out_slots=x[OUT_SLOTS], positions=x[POSITIONS],
                              prefix_lens_cpu=prefix_lens, extend_lens_cpu=[1] * bs)

    def replay(self, batch: AttentionBatch, fence: Callable[[], None] | None = None) -> torch.Tensor:
        """Run the graph of ``batch.num_reqs`` rows (the fixed buffers already filled) -> (bs, V);
        ``fence`` is called between the attention plan and the launch (the stream's waits go there)."""
        bs = batch.num_reqs
        self.attn.prepare_graph(batch, bs)
        if fence is not None:
            fence()
        self._graphs[bs].replay()
        return self.logits[:bs]

    def _forward(self, bs: int) -> torch.Tensor:
        x = self.inputs[:, :bs]
        return self.model.compute_logits(self.model(x[IDS], x[POSITIONS], self.attn), out=self.logits[:bs])

    def _capture(self, req_to_token: torch.Tensor) -> None:
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        for bs in reversed(self.batch_sizes):  # largest first: smaller graphs reuse its memory
            self.attn.prepare_graph(self.batch(req_to_token, bs, [0] * bs), bs)
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm up: lazy inits, kernel selection
                    self._forward(bs)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                self._forward(bs)
            self._graphs[bs] = graph
        torch.cuda.synchronize()
