"""The CUDA decode-size linear (``gemv.cu``): built with nvcc at first use, cached, called via ctypes.

``gemv.cu`` says why it exists (e4m3 weights widened by integer instructions, not the conversion
pipe that bounds the Triton kernels at 37–64 % of bandwidth) and how it works. Here: the build (the
source compiled once per source, device architecture and nvcc into a shared library under the kernel
cache: ``$BANYAN_KERNEL_CACHE``, else ``kernels/`` in Banyan's cache folder: ``shared.model_path.cache_root``),
the launch on torch's current stream (so CUDA graphs capture it), and the configs ``small_m.tune``
times beside its own (``CudaConfig``). No nvcc, no CUDA, a failed build: no configs, and the Triton
kernels and the library paths stand, as before.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from services.worker.kernels.nvcc import arch_flag, build_library, cache_dir, find_nvcc  # noqa: F401 (re-exported)

Tensor = torch.Tensor
log = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("gemv.cu")
SOURCES = (SOURCE, SOURCE.with_name("norm.cu"))  # compiled into one library (and the header they share)
HEADERS = (SOURCE.with_name("pdl.cuh"), SOURCE.with_name("gemv_parts.cuh"))
FP8 = torch.float8_e4m3fn
MAX_M = 8  # rows of x the kernel takes (one 8-column tensor-core tile)
SILU_MAX_M = 2  # rows up to which it computes silu(gate) · up itself (more: the activation kernel first)
_libs: dict[bool, ctypes.CDLL | None] = {}  # per activation type (bf16: True, fp16: False), once tried
_errors: dict[bool, str] = {}  # why it is not there


@dataclass(frozen=True)
class CudaConfig:
    warps: int = 8  # warps a block (16 weight rows), each a contiguous part of K
    unroll: int = 4  # steps (16 bytes a lane of each of its two rows) loaded before their products
    ahead: int = 0  # chunks of ``unroll`` steps prefetched into L2 before they are loaded (sm_90)
    pdl: bool = False  # launched to overlap the kernel before it (programmatic dependent launch, sm_90): its
    # blocks start, and prefetch their first weight chunks, while that kernel's last blocks still run
    pipe: bool = False  # the pipelined kernel (unroll 2, ahead 0): each warp's first chunk loaded into registers
    # before the wait for the kernel before (with PDL: while it ends), each next one before this one's products

    def __str__(self) -> str:
        return f"cuda_w{self.warps}u{self.unroll}a{self.ahead}{'p' * self.pdl}{'d' * self.pipe}"


# (warps, unroll: pairs gemv.cu instantiates; each config won a shape in a recorded start-up — benchmarks/results/*,
# docs/decisions/0007-tuner-configs-that-never-won.md —; the pipelined kernel with 4, 8 and 16 warps, PDL-launched)
CONFIGS = tuple(CudaConfig(w, u, a, pdl) for pdl in (False, True)
                for w, u, a in ((8, 4, 0), (8, 2, 0), (16, 4, 1), (16, 4, 2), (16, 2, 4))
                if (w, u, a, pdl) != (8, 2, 0, False)) + (
    CudaConfig(4, 2, 0, True, True), CudaConfig(8, 2, 0, True, True), CudaConfig(16, 2, 0, True, True))


def build(arch: str, nvcc: str | None = None, out_dir: Path | None = None, bf16: bool = True) -> Path:
    """The shared library for ``arch`` (e.g. ``sm_90a``) and one activation type (bf16, else fp16),
    compiled unless the cache has it → its path. Raises RuntimeError with nvcc's message when the
    build fails."""
    act = "bf16" if bf16 else "fp16"
    return build_library(SOURCES, f"gemv_{arch}_{act}", arch.encode() + act.encode(),
                         [f"-arch={arch}", f"-DBANYAN_GEMV_BF16={int(bf16)}"], nvcc, out_dir, HEADERS)


def library(bf16: bool = True) -> ctypes.CDLL | None:
    """The loaded kernel library for the current CUDA device and activation type (built on first
    call), or None — the reason in ``unavailable()``."""
    if bf16 in _libs:
        return _libs[bf16]
    _libs[bf16] = None
    try:
        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA device")
        cap = torch.cuda.get_device_capability()
        if cap < (8, 0):
            raise RuntimeError(f"compute capability {cap} < 8.0 (mma.sync bf16)")
        lib = ctypes.CDLL(str(build(arch_flag(cap), bf16=bf16)))
        fn = lib.banyan_gemv
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 3 + [ctypes.c_long] * 2 + [ctypes.c_int] * 9 + [
            ctypes.c_void_p]
        norm = lib.banyan_add_rmsnorm
        norm.restype = ctypes.c_int
        norm.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int] * 2 + [ctypes.c_long] * 4 + [
            ctypes.c_float, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
        _libs[bf16] = lib
    except Exception as e:  # (no nvcc, a compiler or driver problem: the other paths stand)
        _errors[bf16] = f"{type(e).__name__}: {e}"[:400]
        log.info("cuda gemv unavailable: %s", _errors[bf16])
    return _libs[bf16]


def unavailable(bf16: bool = True) -> str | None:
    return _errors.get(bf16)


def supports(x: Tensor, w: Tensor) -> bool:
    """Whether the kernel takes ``x @ w.T`` (x (M ≤ 8, K) bf16/fp16; w e4m3 or x's dtype; K a
    multiple of its step; 16-byte aligned rows)."""
    if x.dim() != 2 or w.dim() != 2 or not x.is_cuda or x.dtype not in (torch.bfloat16, torch.float16):
        return False
    if w.dtype not in (FP8, x.dtype) or w.stride(1) != 1 or not 1 <= x.shape[0] <= MAX_M:
        return False
    k = w.shape[1]
    step = 64 if w.dtype == FP8 else 32
    return k % step == 0 and w.stride(0) == k and w.data_ptr() % 16 == 0


def linear(x: Tensor, w: Tensor, scale: Tensor | None, cfg: CudaConfig, silu_mul: bool = False,
           act_out: bool = False) -> Tensor:
    """x (M, K) @ w (N, K)^T (× ``scale`` per output row) → (M, N) in x's dtype, on the current
    stream. ``silu_mul``: x is (M, 2K) = [gate | up] and the product is taken with silu(gate) · up —
    computed inside the kernel for M ≤ ``SILU_MAX_M``, else first by the model's activation kernel.
    ``act_out``: w is [gate | up] (N a multiple of 16) and the result is silu(x gate^T) · (x up^T), (M, N / 2):
    each block reads 8 gate rows and their 8 up rows, the activation made as the sums are stored."""
    if silu_mul and x.shape[0] > SILU_MAX_M:
        from services.worker.kernels.ops import current_ops

        x, silu_mul = current_ops().silu_and_mul(x), False
    bf16 = x.dtype == torch.bfloat16
    lib = library(bf16)
    if lib is None:
        raise RuntimeError(f"cuda gemv unavailable: {unavailable(bf16)}")
    if x.stride(1) != 1 or (x.stride(0) * x.element_size()) % 16 or x.data_ptr() % 16:
        x = x.contiguous()
    m, k, n = x.shape[0], w.shape[1], w.shape[0]
    if not supports(x, w) or x.shape[1] != (2 * k if silu_mul else k) or (act_out and (n % 16 or silu_mul)):
        raise ValueError(f"cuda gemv: unsupported x {tuple(x.shape)} {x.dtype} @ w {tuple(w.shape)} {w.dtype}"
                         + (" with the activation" if act_out else ""))
    if scale is not None:
        scale = scale.float().contiguous()
    y = torch.empty((m, n // 2 if act_out else n), dtype=x.dtype, device=x.device)
    rc = lib.banyan_gemv(x.data_ptr(), w.data_ptr(), scale.data_ptr() if scale is not None else None, y.data_ptr(),
                         m, n, k, x.stride(0), y.stride(0), int(w.dtype == FP8), int(bf16), cfg.warps, cfg.unroll,
                         cfg.ahead, int(cfg.pdl), int(silu_mul), int(cfg.pipe), int(act_out),
                         torch.cuda.current_stream(x.device).cuda_stream)
    if rc != 0:
        raise RuntimeError(f"cuda gemv: launch failed ({rc}) for {cfg}")
    return y


def _aligned_rows(x: Tensor, residual: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """x and the residual as the norm kernels read them: unit stride along a row, rows 16-byte aligned, the
    residual x's shape and dtype (copies only where they are not)."""
    if x.stride(1) != 1 or x.stride(0) % 8 or x.data_ptr() % 16:
        x = x.contiguous()
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype or residual.stride(1) != 1
                                 or residual.stride(0) % 8 or residual.data_ptr() % 16):
        residual = residual.reshape(x.shape).to(x.dtype).contiguous()
    return x, residual


NORM_MAX_M = 8  # rows up to which ``add_rmsnorm`` is used (a block a row)


def norm_supports(x: Tensor, weight: Tensor) -> bool:
    """Whether ``add_rmsnorm`` takes x (M ≤ NORM_MAX_M, K) bf16/fp16 with a (K,) weight of its dtype."""
    return (x.dim() == 2 and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype
            and 1 <= x.shape[0] <= NORM_MAX_M and x.shape[1] % 8 == 0 and x.shape[1] <= 32768
            and weight.shape == (x.shape[1],) and library(x.dtype == torch.bfloat16) is not None)


def add_rmsnorm(x: Tensor, residual: Tensor | None, weight: Tensor, eps: float, pdl: bool = True
                ) -> tuple[Tensor, Tensor]:
    """(rmsnorm(x + residual) · weight, x + residual) as the PyTorch reference rounds them (without
    ``residual``: (rmsnorm(x) · weight, x)), new tensors, one kernel (``norm.cu``) on the current stream;
    ``pdl``: launched to overlap the kernel before it, and letting the one after it start at once."""
    if not norm_supports(x, weight):
        raise ValueError(f"cuda add_rmsnorm: unsupported x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)}")
    return launch_add_rmsnorm(x, residual, weight, eps, pdl)


def launch_add_rmsnorm(x: Tensor, residual: Tensor | None, weight: Tensor, eps: float, pdl: bool = True
                       ) -> tuple[Tensor, Tensor]:
    """``add_rmsnorm`` for inputs ``norm_supports`` has already taken (the per-step path: no second check)."""
    x, residual = _aligned_rows(x, residual)
    weight = weight.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(out) if residual is not None else x
    lib = library(x.dtype == torch.bfloat16)
    rc = lib.banyan_add_rmsnorm(x.data_ptr(), residual.data_ptr() if residual is not None else None,
                                weight.data_ptr(), out.data_ptr(), res_out.data_ptr() if residual is not None else None,
                                x.shape[0], x.shape[1], x.stride(0), residual.stride(0) if residual is not None else 0,
                                out.stride(0), out.stride(0), eps, int(x.dtype == torch.bfloat16), int(pdl),
                                torch.cuda.current_stream(x.device).cuda_stream)
    if rc != 0:
        raise RuntimeError(f"cuda add_rmsnorm: launch failed ({rc})")
    return out, res_out


def configs_for(w: Tensor, x: Tensor) -> tuple[CudaConfig, ...]:
    """The configs to time for ``x @ w.T`` (none when the kernel does not take it or is unavailable)."""
    return CONFIGS if supports(x, w) and library(x.dtype == torch.bfloat16) is not None else ()


# --- the widening, as the kernel does it, in torch integer ops: the CPU tests check it exactly ----------

def widen_reference(codes: Tensor, bf16: bool = True) -> Tensor:
    """e4m3 bytes (uint8) → the 16-bit patterns ``gemv.cu``'s ``widen4`` makes (int32 holding the
    pattern): a sign-extended byte shifted into place and masked; the value they stand for is the
    e4m3 value × 2^-120 (bf16) or × 2^-8 (f16)."""
    sext = codes.to(torch.int32)
    sext = torch.where(sext >= 128, sext - 256, sext) & 0xFFFF  # the byte sign-extended over 16 bits (PRMT)
    return ((sext << 4) & 0x87F0) if bf16 else ((sext << 7) & 0xBF80)
