"""Piecewise CUDA graphs: the eager steps (prefill chunks, prompts mixed with decodes, shared-prefix
steps) of up to ``max_tokens`` tokens replay the work *between* two attentions from CUDA graphs,
and only the attention (whose plan depends on every request's lengths) runs eagerly.

An eager step queues ~30 kernels a layer from Python, ~0.6 ms of host time a layer on the H200's
host (~20 ms a step for an 8B model): a step of a few hundred tokens, ~12 ms of device work, is
bound by that launch. Here a step of T tokens replays, for the captured size
``size_for(T)`` ≥ T (padded), L + 1 graphs for L layers:

    graph 0: embed, layer 0's input norm, q/k/v projection, rope + KV write → q, k, v buffers, the pool
    attention of layer 0 (eager: the step's plan)                           → its output buffer
    graph i: layer i-1's o-projection, norm, MLP; layer i's norm, q/k/v, rope + KV write
    …
    graph L: the last layer's o-projection, norm, MLP; the final norm     → hidden buffer

The graphs read and write fixed buffers (token ids, positions, KV slots, q, k, v, attention output,
hidden); the residual stream is carried from graph to graph in the graphs' own memory (one pool for
every size: graphs of one size replay in capture order, never interleaved with another size's).
Padding rows (token id stale, position 0, slot 0 — the pool's padding slot, never allocated — the
attention sees only the step's T rows) compute garbage that no real row reads: every op between
attentions is row-wise. The rope and the KV write inside the graphs leave one launch a layer to the
eager attention (a mixed step of W5 is bound by the host's launches). Without a pool
(``pool=None``) the attention rotates and writes, as in the model's own forward.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from services.worker.attention.base import AttentionBackend
from services.worker.kv_pool import KVPool


def token_sizes(max_tokens: int) -> list[int]:
    """16, 32, 64, 96, 128, then steps of a quarter of the power of two below (≤ 25 % padding)."""
    sizes, n = [16, 32, 64, 96], 128
    while n < max_tokens:
        sizes.append(n)
        n += max(32, 1 << (n.bit_length() - 3))  # 128, 160, …, 256, 320, …, 512, 640, …
    return sorted({s for s in sizes if s < max_tokens} | {max_tokens})


class PiecewiseGraphs:
    def __init__(self, model, max_tokens: int, device: torch.device, dtype: torch.dtype, capture: bool = True,
                 pool: KVPool | None = None) -> None:
        """``capture=False`` (tests, on the CPU): the pieces run eagerly in place of their graphs. ``pool``: the
        pieces rotate q/k and write each layer's K/V there (``forward`` then takes the step's slots)."""
        inner = model.model
        self.embed, self.layers, self.norm, self.rotary = inner.embed_tokens, list(inner.layers), inner.norm, \
            inner.rotary_emb
        self.sizes = token_sizes(max_tokens)
        attn0 = self.layers[0].self_attn
        (hq, d), (hkv, _) = attn0.q_shape, attn0.kv_shape
        t, hidden = self.sizes[-1], self.embed.weight.shape[1]
        self.dtype = dtype
        self.ids = torch.zeros(t, dtype=torch.int64, device=device)
        self.q = torch.zeros((t, hq, d), dtype=dtype, device=device)
        self.k = torch.zeros((t, hkv, d), dtype=dtype, device=device)
        self.v = torch.zeros((t, hkv, d), dtype=dtype, device=device)
        self.attn_out = torch.zeros((t, hq * d), dtype=dtype, device=device)
        self.hidden = torch.zeros((t, hidden), dtype=dtype, device=device)
        self.pool = pool
        self.where = torch.zeros((2, t), dtype=torch.int64, device=device)  # each row's position and KV slot
        self._graphs: dict[int, list] = {}
        if capture:
            self._capture()
        else:
            self._graphs = {t: [_Eager(p) for p in self._pieces(t)] for t in self.sizes}

    def size_for(self, num_tokens: int) -> int | None:
        """The captured size a step of ``num_tokens`` tokens replays (None: too large, eager)."""
        if num_tokens > self.sizes[-1]:
            return None
        return next(s for s in self.sizes if s >= num_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend,
                between_layers: Callable[[], None] | None = None, slots: torch.Tensor | None = None) -> torch.Tensor:
        """As the model's forward (attention planned already; ``slots``: the new tokens' KV slots, with a
        pool) → hidden (T, H), a view of the fixed output buffer: valid until the next step's replay
        (later work on the stream reads it first)."""
        t = input_ids.shape[0]
        size = self.size_for(t)
        graphs = self._graphs[size]
        self.ids[:t].copy_(input_ids)
        rope, written = None, self.pool is not None
        if written:
            if slots is None:
                raise ValueError("piecewise graphs that write the KV need the step's slots")
            self.where[0, :t].copy_(positions)
            self.where[1, :t].copy_(slots)
            self.where[:, t:size].zero_()  # (padding rows: the last step's slots must not be written again)
        else:
            rope = self.rotary(positions, self.dtype)
        graphs[0].replay()
        for i, layer in enumerate(self.layers):
            out = attn.forward(self.q[:t], self.k[:t], self.v[:t], layer.self_attn.layer, rope, written=written)
            self.attn_out[:t].copy_(out.flatten(1))
            graphs[i + 1].replay()
            if between_layers is not None:
                between_layers()
        return self.hidden[:t]

    # --- capture -------------------------------------------------------------------------------
    def _pieces(self, t: int) -> list[Callable[[], None]]:
        """The L + 1 pieces of a step of ``t`` tokens; the residual stream passes through ``state``."""
        state: dict[str, torch.Tensor] = {}

        def stash(i: int, q, k, v, residual) -> None:
            bq, bk, bv = self.q[:t], self.k[:t], self.v[:t]
            bq.copy_(q)
            bk.copy_(k)
            bv.copy_(v)
            state["residual"] = residual
            if self.pool is not None:  # (the rotation built in the piece: captured with it, from the buffer)
                rope = self.rotary(self.where[0, :t], self.dtype)
                q, k = self.pool.store_rope(self.layers[i].self_attn.layer, self.where[1, :t], bq, bk, bv, rope)
                if q is not bq:  # (a rope that is not in place: rotated copies)
                    bq.copy_(q)
                    bk.copy_(k)

        def first() -> None:
            stash(0, *self.layers[0].before_attention(self.embed(self.ids[:t]), None))

        def between(i: int) -> Callable[[], None]:
            def piece() -> None:
                x, residual = self.layers[i - 1].after_attention(self.attn_out[:t], state["residual"])
                stash(i, *self.layers[i].before_attention(x, residual))
            return piece

        def last() -> None:
            x, residual = self.layers[-1].after_attention(self.attn_out[:t], state.pop("residual"))
            self.hidden[:t].copy_(self.norm(x, residual)[0])

        return [first, *(between(i) for i in range(1, len(self.layers))), last]

    @torch.inference_mode()
    def _capture(self) -> None:
        pool, stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream()
        for t in reversed(self.sizes):  # largest first: the smaller sizes fit in its memory
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for piece in self._pieces(t):  # warm up (lazy inits, kernel choices), eagerly
                    piece()
            torch.cuda.current_stream().wait_stream(stream)
            graphs = []
            for piece in self._pieces(t):  # (one list: the residual passes from piece to piece)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    piece()
                graphs.append(graph)
            self._graphs[t] = graphs
        torch.cuda.synchronize()


class _Eager:
    """A piece called where its graph would be replayed."""

    def __init__(self, piece: Callable[[], None]) -> None:
        self.replay = piece
