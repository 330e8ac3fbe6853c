"""Model building blocks with tensor parallelism built in (rotary embedding: rotary.py; the kernels
behind norms and activations: ops.py, bound when a layer is built).

Every parameter carries a ``weight_loader(param, loaded, shard_id=None)`` that copies this rank's
part of a checkpoint tensor into it; fused parameters (q/k/v, gate/up) also carry ``shard_ids``,
the shards that must all be loaded. Parameters are created with ``torch.empty`` under the
caller's default device and dtype, and are filled only by their loaders.

Linear layers built inside ``quant.fp8_linears(True)`` hold FP8 (e4m3) weights and a per-row
``weight_scale`` (``derived``: filled by the weight's loader, from the checkpoint's FP8 weight and
scale or by quantizing its weight) and multiply through ``quant.fp8.fp8_linear``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from services.worker.kernels.ops import current_ops
from services.worker.tp import TPGroup
from services.worker import kernels
from services.worker.quant import fp8_linears_enabled, fp8_vocab_enabled
from services.worker.quant import fp8
from services.worker.quant.fp8 import FP8, QuantizedActivation, QuantizedWeight, fp8_linear, load_fp8_rows

ShardId = str | int | None
WeightLoader = Callable[[nn.Parameter, torch.Tensor, ShardId], None]


def divide(n: int, d: int) -> int:
    if n % d:
        raise ValueError(f"{n} is not divisible by the tensor-parallel size {d}")
    return n // d


def kv_heads_per_rank(num_kv_heads: int, tp_size: int) -> int:
    """KV heads are split across ranks, or replicated when there are fewer heads than ranks."""
    if num_kv_heads >= tp_size:
        return divide(num_kv_heads, tp_size)
    if tp_size % num_kv_heads:
        raise ValueError(f"{num_kv_heads} KV heads cannot be replicated evenly over {tp_size} ranks")
    return 1


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    if isinstance(src, QuantizedWeight):  # (the checkpoint reader passes these to FP8 linears only)
        raise ValueError(f"an FP8 checkpoint weight for a parameter of dtype {dst.dtype}")
    if dst.shape != src.shape:
        raise ValueError(f"checkpoint shard has shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
    dst.copy_(src)


def load_replicated(param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
    _copy(param.data, loaded)


def _param(*shape: int, loader: WeightLoader = load_replicated, dtype: torch.dtype | None = None) -> nn.Parameter:
    param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    param.weight_loader = loader
    return param


class _Linear(nn.Module):
    """The weight (out, in) of a linear layer, FP8 with ``weight_scale`` when built so."""

    def _init_weight(self, out_features: int, in_features: int) -> None:
        self.fp8 = fp8_linears_enabled()
        self.weight = _param(out_features, in_features, loader=self.weight_loader, dtype=FP8 if self.fp8 else None)
        if self.fp8:
            self.weight_scale = _param(out_features, loader=self.weight_loader, dtype=torch.float32)
            self.weight_scale.derived = True

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
        raise NotImplementedError

    def _matmul(self, x: torch.Tensor | QuantizedActivation, bias: torch.Tensor | None) -> torch.Tensor:
        if self.fp8:
            return fp8_linear(x, self.weight, self.weight_scale, bias)
        y = kernels.try_small_m(x, self.weight, None, bias)  # (decode sizes, where the kernel measured faster)
        if y is None and (y := kernels.try_gemm(x, self.weight, x.dtype)) is not None and bias is not None:
            y = y + bias  # (decode batches: our GEMM where it measured faster)
        return y if y is not None else F.linear(x, self.weight, bias)

    def quantized(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(weight, its per-row scale or None)."""
        return self.weight, self.weight_scale if self.fp8 else None

    def quantizes(self, x: torch.Tensor, *small_m: str) -> bool:
        """Whether this layer would quantize ``x`` (T, in) itself — FP8, the library GEMM at x's rows: no small-M
        kernel for its shape there, plain or of the ``small_m`` kinds ("silu_mul", "act_out") the caller would
        try first — so the op making x may instead (``quant.fp8.FusedQuant``)."""
        if not (self.fp8 and fp8.takes_quantized(x, self.weight)):
            return False
        return all(kernels.small_m_config(x, self.weight, **({kind: True} if kind else {})) is None
                   for kind in ("", *small_m))


@dataclass(frozen=True)
class _Shard:
    offset: int  # first row in this rank's fused parameter
    size: int  # rows
    start: int  # first row in the checkpoint tensor


class _ColumnSharded(_Linear):
    """y = x W^T + b where W (and b) hold this rank's rows of one or more checkpoint tensors."""

    def __init__(self, in_features: int, shards: dict[ShardId, _Shard], bias: bool) -> None:
        super().__init__()
        self._shards = shards
        out_features = sum(s.size for s in shards.values())
        self._init_weight(out_features, in_features)
        self.bias = _param(out_features, loader=self.weight_loader) if bias else None
        if list(shards) != [None]:
            for p in self.parameters():
                p.shard_ids = tuple(shards)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
        s = self._shards[shard_id]
        if self.fp8 and param is self.weight:
            load_fp8_rows(param.data, self.weight_scale.data, loaded, (s.offset, s.size), (s.start, s.size))
        else:
            _copy(param.data.narrow(0, s.offset, s.size), loaded.narrow(0, s.start, s.size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, in) -> (T, out_local)
        return self._matmul(x, self.bias)


class ColumnParallelLinear(_ColumnSharded):
    """Output features split across ranks; the output stays sharded."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup) -> None:
        n = divide(out_features, tp.size)
        super().__init__(in_features, {None: _Shard(0, n, tp.rank * n)}, bias)


class MergedColumnParallelLinear(_ColumnSharded):
    """Several column-parallel projections fused into one matmul (shard ids 0, 1, ...)."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool, tp: TPGroup) -> None:
        shards: dict[ShardId, _Shard] = {}
        offset = 0
        for i, size in enumerate(out_sizes):
            n = divide(size, tp.size)
            shards[i] = _Shard(offset, n, tp.rank * n)
            offset += n
        super().__init__(in_features, shards, bias)


class GateUpParallelLinear(MergedColumnParallelLinear):
    """The gate and up projections fused, [gate | up] (shard ids 0, 1), whose output feeds SiluAndMul."""

    silu_mul_output = True  # (``startup.tune_small_m`` times the kernel that makes the activation as it stores)

    def __init__(self, in_features: int, intermediate: int, bias: bool, tp: TPGroup) -> None:
        super().__init__(in_features, [intermediate, intermediate], bias, tp)

    def forward_silu_mul(self, x: torch.Tensor | QuantizedActivation) -> torch.Tensor | None:
        """silu(gate) · up of this projection (T, I_local) in one kernel at decode sizes, where it measured
        faster than the projection then the activation; else None."""
        if self.bias is not None or isinstance(x, QuantizedActivation):
            return None
        return kernels.try_small_m(x, self.weight, self.weight_scale if self.fp8 else None, act_out=True)


class QKVParallelLinear(_ColumnSharded):
    """Fused q/k/v projection (shard ids "q", "k", "v"); output (T, (Hq + 2 Hkv) D) of local heads."""

    def __init__(
        self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool, tp: TPGroup
    ) -> None:
        num_heads_local = divide(num_heads, tp.size)
        num_kv_local = kv_heads_per_rank(num_kv_heads, tp.size)
        kv_shard = tp.rank * num_kv_heads // tp.size if num_kv_heads < tp.size else tp.rank  # replicas share one
        q, kv = num_heads_local * head_dim, num_kv_local * head_dim
        shards: dict[ShardId, _Shard] = {
            "q": _Shard(0, q, tp.rank * q),
            "k": _Shard(q, kv, kv_shard * kv),
            "v": _Shard(q + kv, kv, kv_shard * kv),
        }
        super().__init__(hidden, shards, bias)
        self.num_heads, self.num_kv_heads = num_heads_local, num_kv_local  # this rank's heads


class RowParallelLinear(_Linear):
    """Input features split across ranks; partial outputs are all-reduced, then the bias added."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.in_per_rank = divide(in_features, tp.size)
        self._init_weight(out_features, self.in_per_rank)
        self.bias = _param(out_features) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
        cols = (self.tp.rank * self.in_per_rank, self.in_per_rank)
        if self.fp8 and param is self.weight:  # (whole rows' scales: the same on every rank)
            rows = (0, param.shape[0])
            load_fp8_rows(param.data, self.weight_scale.data, loaded, rows, rows, cols)
        else:
            _copy(param.data, loaded.narrow(1, *cols))

    silu_mul_input = False  # (set by an MLP whose activation feeds it: ``forward_silu_mul``)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, in_local) -> (T, out)
        return self._reduce(self._matmul(x, None))

    def forward_silu_mul(self, h: torch.Tensor, act: nn.Module) -> torch.Tensor:  # (T, 2·in_local) -> (T, out)
        """``self(act(h))`` for act = SiluAndMul: at decode sizes, where it measured faster, one
        kernel that applies the activation while it reads the weight."""
        local = kernels.try_small_m(h, self.weight, self.weight_scale if self.fp8 else None, None, silu_mul=True)
        if local is not None:
            return self._reduce(local)
        if self.quantizes(h, "silu_mul") and (fused := fp8.fused_quant()) is not None:
            return self(fused.silu_mul(h) if fused.silu_mul is not None else fp8.quantize_activation(act(h)))
        return self(act(h))

    def _reduce(self, local: torch.Tensor) -> torch.Tensor:
        """This rank's partial product → the sum over ranks, plus the bias."""
        y = self.tp.all_reduce(local)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Vocabulary rows split across ranks (padded to equal shards); lookups are all-reduced. Built
    inside ``quant.fp8_linears(..., vocab=True)`` it holds e4m3 rows and a per-row ``weight_scale``."""

    def __init__(self, vocab_size: int, hidden: int, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        per_rank = math.ceil(vocab_size / tp.size)
        self.start = min(tp.rank * per_rank, vocab_size)
        self.end = min(self.start + per_rank, vocab_size)
        self.fp8, self.out_dtype = fp8_vocab_enabled(), torch.get_default_dtype()
        self.weight = _param(per_rank, hidden, loader=self.weight_loader, dtype=FP8 if self.fp8 else None)
        if self.fp8:
            self.weight_scale = _param(per_rank, loader=self.weight_loader, dtype=torch.float32)
            self.weight_scale.derived = True

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
        n = self.end - self.start
        param.data[n:].zero_()  # padding rows
        if self.fp8:
            self.weight_scale.data[n:].zero_()
            load_fp8_rows(param.data, self.weight_scale.data, loaded, (0, n), (self.start, n))
        else:
            _copy(param.data[:n], loaded[self.start : self.end])

    def _rows(self, rows: torch.Tensor) -> torch.Tensor:
        if not self.fp8:
            return F.embedding(rows, self.weight)
        q = self.weight.view(torch.uint8).index_select(0, rows).view(FP8)  # (as bytes: every device gathers those)
        s = self.weight_scale.index_select(0, rows)
        return (q.float() * s[:, None]).to(self.out_dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # (T,) -> (T, H)
        if self.tp.size == 1:
            return self._rows(ids)
        mine = (ids >= self.start) & (ids < self.end)  # (T,)
        out = self._rows(torch.where(mine, ids - self.start, 0))
        return self.tp.all_reduce(out.masked_fill_(~mine[:, None], 0))


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection sharded like the embedding (so it can share its weight)."""

    def forward(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """(N, H) -> (N, V) float32, into ``out`` (N, V) when given (a CUDA graph's shared buffer)."""
        if self.fp8:
            local = fp8_linear(hidden, self.weight, self.weight_scale, None)
        else:
            local = kernels.try_small_m(hidden, self.weight)  # (decode sizes, where the kernel measured faster)
            if local is None:
                local = kernels.try_gemm(hidden, self.weight, hidden.dtype)
            if local is None:
                local = F.linear(hidden, self.weight)
        logits = self.tp.all_gather(local)[:, : self.vocab_size]  # (N, V)
        return logits.float() if out is None else out.copy_(logits)

    def quantized(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(weight, its per-row scale or None): what ``startup.tune_small_m`` times."""
        return self.weight, self.weight_scale if self.fp8 else None


class RMSNorm(nn.Module):
    """RMSNorm; given a ``residual``, first adds it: returns (norm(x + residual), x + residual)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _param(dim)
        ops = current_ops()
        self._norm, self._add_norm = ops.rmsnorm, ops.fused_add_rmsnorm

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):  # (..., dim)
        if residual is None:
            return self._norm(x, self.weight, self.eps)
        return self._add_norm(x, residual, self.weight, self.eps)

    def then(self, linear: "_ColumnSharded", x: torch.Tensor, residual: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """(linear(norm(x + residual)), x + residual) — without a residual (linear(norm(x)), x)."""
        h, residual = self.for_linear(linear, x, residual)
        return linear(h), residual

    def for_linear(self, linear: _Linear, x: torch.Tensor, residual: torch.Tensor | None = None, *small_m: str
                   ) -> tuple[torch.Tensor | QuantizedActivation, torch.Tensor]:
        """(norm(x + residual), x + residual) as ``linear`` takes it: quantized by the norm's kernel where the
        linear would quantize it itself (``_Linear.quantizes``, with the ``small_m`` kinds it tries first), else as
        it is; without a residual (norm(x), x)."""
        if linear.quantizes(x, *small_m) and (fused := fp8.fused_quant()) is not None:
            if fused.add_rmsnorm is not None and (done := fused.add_rmsnorm(x, residual, self.weight, self.eps)):
                return done
            h, residual = (self(x), x) if residual is None else self(x, residual)
            return fp8.quantize_activation(h), residual
        return (self(x), x) if residual is None else self(x, residual)


class SiluAndMul(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self._fn = current_ops().silu_and_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, 2I) -> (T, I)
        return self._fn(x)
