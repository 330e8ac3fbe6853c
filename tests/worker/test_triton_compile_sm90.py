"""Banyan's Triton kernels compiled for the H200 (sm_90) on this machine, no GPU needed: Triton's front end, its
optimizer, LLVM and ptxas run on the host, so a kernel that would not compile on the GPU (a construct the
interpreter accepts but the compiler does not, a register or shared-memory overflow, inline PTX ptxas rejects)
fails here, in CI, before a device call is spent on it. The configurations are the served ones
(``triton_decode.decode``'s choices, ``rope_store``'s two launches). And what two of the decode's properties
compile to: the merge of a request's parts loads them a part a load with no barrier between the loads (each part's
sum is its threads' own; a cross-thread reduction a part would make the kernel's end a chain of L2 round trips,
and all the parts as one tile measured slower on the H200); with the
rope inside, the first block's table slots are prefetched into L1 before the rope's barrier (after it, the loop's
first load of them would be one more round trip before the K/V loads). The interpreter tests check the results, but
never trace ``WARM``: inline assembly is not interpreted. Skipped visibly where Triton or its CUDA back
end is not installed."""

from __future__ import annotations

import re

import pytest

triton = pytest.importorskip("triton", reason="Triton is not installed")

POINTERS = {  # argument name → Triton pointer type (the pool's dtype substituted for "pool")
    "Q": "*bf16", "K": "pool", "V": "pool", "Table": "*i32", "Rows": "*i64", "Prefix": "*i64", "Start": "*i64",
    "Opart": "*fp32", "Lpart": "*fp32", "Out": "*bf16", "Lse": "*fp32", "Count": "*i32", "Knew": "*bf16",
    "Vnew": "*bf16", "CosSin": "*fp32", "Pos": "*i64", "Slots": "*i64", "KInv": "*fp32", "VInv": "*fp32",
    "q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "kc_ptr": "pool", "vc_ptr": "pool", "slots_ptr": "*i64",
    "pos_ptr": "*i64", "cs_ptr": "*fp32", "k_inv_ptr": "*fp32", "v_inv_ptr": "*fp32",
}
FLOATS = {"qk_scale", "v_scale", "eps"}


def compile_sm90(fn, constexprs: dict, pool: str, num_warps: int = 4, num_stages: int = 2, aligned: bool = False,
                 pointers: dict | None = None):
    """``aligned``: every pointer and integer argument taken as a multiple of 16, as a launch specializes the
    served ones (strides of 128-wide heads, 16-byte aligned tensors): the vector loads they compile to.
    ``pointers``: this kernel's pointer types where they differ from ``POINTERS``."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig, types = {}, {**POINTERS, **(pointers or {})}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in types:
            sig[name] = pool if types[name] == "pool" else types[name]
        else:
            sig[name] = "fp32" if name in FLOATS else "i32"
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n, t in sig.items()
             if aligned and t not in ("constexpr", "fp32")}
    src = ASTSource(fn, sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps,
                                                                         "num_stages": num_stages})


def backend_or_skip() -> None:
    try:
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
    except Exception as e:  # (a Triton build without the CUDA back end)
        pytest.skip(f"Triton's CUDA back end is not installed: {e}")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("quant", [False, True])
def test_rope_store_kernels_compile(quant) -> None:
    backend_or_skip()
    from services.worker.kernels import rope_store as rs

    pool = "*fp8e4nv" if quant else "*bf16"
    common = {"QUANT": quant, "FMAX": 448.0, "HALF": 64}
    decode = {**common, "BLOCK_T": 1, "PDL": True}  # (a token a program, PDL-launched)
    assert "cubin" in compile_sm90(rs._rope_store_kernel, decode, pool, num_warps=1).asm
    prompts = {**common, "BLOCK_T": rs.ROWS_BLOCK, "PDL": False}
    assert "cubin" in compile_sm90(rs._rope_store_kernel, prompts, pool).asm


@pytest.mark.timeout(300)
def test_the_fp8_activation_kernels_compile() -> None:
    """Per-token quantization, and the add-RMSNorm / SiLU-and-multiply that quantize as they write, at the 8B
    shapes' launches (a 4,096-wide row in one block; 14,336 in 4,096-wide blocks)."""
    backend_or_skip()
    from services.worker.quant import triton_kernels as tk

    types = {"x_ptr": "*bf16", "r_ptr": "*bf16", "w_ptr": "*bf16", "h_ptr": "*bf16", "q_ptr": "*fp8e4nv",
             "s_ptr": "*fp32", "r_out_ptr": "*bf16", "K": "i32"}
    common = {"FMAX": 448.0, "TINY": 1e-12}
    for res in (True, False):
        assert "cubin" in compile_sm90(tk._add_rmsnorm_quant_kernel, {**common, "HAS_RES": res, "BLOCK": 4096},
                                       "*bf16", num_warps=8, pointers=types).asm
    assert "cubin" in compile_sm90(tk._silu_mul_quant_kernel, {**common, "BLOCK": 4096}, "*bf16", num_warps=8,
                                   pointers=types).asm
    assert "cubin" in compile_sm90(tk._per_token_quant_kernel, {**common, "BLOCK": 4096}, "*bf16", num_warps=8,
                                   pointers=types).asm


@pytest.mark.timeout(300)
def test_the_gemm_compiles_to_wgmma_without_spills() -> None:
    """Every config ``gemm.tune`` may pick, as a launch specializes it (aligned, K a multiple of the tile): Hopper's
    tensor-core instruction on e4m3 (FP8) or bf16 operands (``wgmma`` — the point of the kernel), no local memory
    (spills), shared memory within the H200's 227 KiB a block; the FP8 tensor cores' sums promoted to float32 a tile
    at a time (as cuBLAS without fast accumulation: ``BANYAN_FP8_FAST_ACCUM=0``), and not by default."""
    backend_or_skip()
    from services.worker.kernels import gemm

    cases = ([(c, "fp8e4nv", precise) for c in gemm.CONFIGS for precise in (True, False)]
             + [(c, "bf16", False) for c in gemm.PLAIN_CONFIGS])
    for cfg, dt, precise in cases:
        types = {"a_ptr": f"*{dt}", "b_ptr": f"*{dt}", "sa_ptr": "*fp32", "sb_ptr": "*fp32", "c_ptr": "*bf16",
                 "K": "i32"}
        k = compile_sm90(gemm._gemm_kernel, {"SCALED": dt != "bf16", "EVEN_K": True, "PRECISE": precise,
                                             "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k,
                                             "GROUP_M": cfg.group_m},
                         "*bf16", num_warps=cfg.warps, num_stages=cfg.stages, aligned=True, pointers=types)
        ptx = k.asm["ptx"]
        assert re.search(r"wgmma\.mma_async\S*" + ("e4m3" if dt != "bf16" else "bf16"), ptx), (cfg, dt)
        assert ".local" not in ptx and k.metadata.shared <= 227 << 10, (cfg, dt)
        # promoted to float32 every tile (a float32 add per accumulator) unless fast accumulation
        assert bool(re.search(r"add(\.rn)?\.f32", ptx)) == precise, (cfg, dt, precise)


SERVED = {  # the decode's launches: W1 (bf16, many splits; a batch-1 graph's, rope inside), large FP8 batches
    # (one split, rope inside), a
    # cascade step's own level on an FP8 pool (starts, LSE), integer widening both ways
    "bf16_splits8": dict(pool="*bf16", SPLITS=8, BLOCK=64, F16=False, WIDEN=0, ROPE=False, QUANT=False, stages=2),
    "bf16_splits16_rope": dict(pool="*bf16", SPLITS=16, BLOCK=64, F16=False, WIDEN=0, ROPE=True, QUANT=False,
                                stages=2),
    "fp8_one_split_rope": dict(pool="*fp8e4nv", SPLITS=1, BLOCK=128, F16=True, WIDEN=2, ROPE=True, QUANT=True,
                               stages=3),
    "fp8_own_level": dict(pool="*fp8e4nv", SPLITS=2, BLOCK=128, F16=True, WIDEN=2, ROPE=False, QUANT=False,
                          HAS_START=True, WRITE_LSE=True, stages=3),
    "fp8_int_widen": dict(pool="*fp8e4nv", SPLITS=4, BLOCK=64, F16=True, WIDEN=1, ROPE=False, QUANT=False, stages=3),
    # FP8 from 512 rows: 64-token blocks on 2 warps (a W3 own level: starts, LSE); bf16 at one split
    "fp8_narrow_own_level": dict(pool="*fp8e4nv", SPLITS=1, BLOCK=64, F16=True, WIDEN=2, ROPE=False, QUANT=False,
                                 HAS_START=True, WRITE_LSE=True, stages=3, warps=2),
    # BANYAN_DECODE_PIPE=1: the table slots a block ahead (3 stages, 32-token blocks)
    "bf16_pipe_rope": dict(pool="*bf16", SPLITS=2, BLOCK=32, F16=False, WIDEN=0, ROPE=True, QUANT=False, PIPE=True,
                           stages=3),
    "bf16_one_split_own_level": dict(pool="*bf16", SPLITS=1, BLOCK=64, F16=False, WIDEN=0, ROPE=False, QUANT=False,
                                     HAS_START=True, WRITE_LSE=True, stages=2),
}


def compile_decode(name: str, aligned: bool = False, **over):
    from services.worker.attention import triton_decode as td

    cfg = dict(SERVED[name], **over)
    pool, stages, warps = cfg.pop("pool"), cfg.pop("stages"), cfg.pop("warps", 4)
    splits = cfg["SPLITS"]
    constexprs = dict(G=4, BLOCK_H=16, D=128, BLOCK_D=128, BLOCK_S=triton.next_power_of_2(splits), HAS_START=False,
                      WRITE_LSE=False, PDL=True, FMAX=448.0, MIN_PER=0, BLOCK_G=4,
                      WARM=cfg.get("ROPE", False), PIPE=False)  # (as ``decode`` sets them on CUDA, G = 4, D = 128)
    constexprs.update(cfg)
    return compile_sm90(td._partial_kernel, constexprs, pool, num_warps=warps, num_stages=stages, aligned=aligned)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", sorted(SERVED))
def test_the_decode_attention_compiles(name) -> None:
    backend_or_skip()
    assert "cubin" in compile_decode(name).asm


@pytest.mark.timeout(300)
def test_the_merge_loads_a_part_a_load_with_no_barrier_between_them() -> None:
    backend_or_skip()
    lines = compile_decode("bf16_splits16_rope", aligned=True).asm["ptx"].splitlines()
    start = next(i for i, line in enumerate(lines) if "atom.global.gpu.acq_rel.add" in line)  # (the pair's count)
    parts = [i for i, line in enumerate(lines) if i > start and "ld.global.cg.v4" in line]
    assert len(parts) == 16  # (one 16-byte load a thread for each of the 16 parts: (4 heads, 128) values a part)
    assert not any("bar.sync" in line for line in lines[parts[0]:parts[-1]])
    lses = [i for i, line in enumerate(lines) if start < i < parts[0] and "ld.global.cg.b32" in line]
    assert len(lses) >= 16  # (the parts' LSEs first: their maximum and sum before the values)


@pytest.mark.timeout(300)
def test_with_the_rope_inside_the_first_slots_are_prefetched_before_the_ropes_barrier() -> None:
    backend_or_skip()
    lines = compile_decode("bf16_splits16_rope", aligned=True).asm["ptx"].splitlines()
    l1 = [i for i, line in enumerate(lines) if "prefetch.global.L1" in line]
    first_bar = next(i for i, line in enumerate(lines) if "bar.sync" in line)
    assert l1 and max(l1) < first_bar
    assert "prefetch.global.L1" not in compile_decode("bf16_splits16_rope", aligned=True,
                                                      WARM=False).asm["ptx"]


@pytest.mark.timeout(300)
def test_with_the_slots_a_block_ahead_the_kv_loads_stay_in_flight_across_iterations() -> None:
    """``BANYAN_DECODE_PIPE=1``: the K/V copies wait for all but the newest groups (two buffers at 3 stages, in
    shared memory), where the served bf16 launch waits for every copy at each iteration's top (one buffer)."""
    backend_or_skip()
    waits = lambda k: {int(n) for n in re.findall(r"cp\.async\.wait_group\s+(\d+)", k.asm["ptx"])}  # noqa: E731
    piped = compile_decode("bf16_pipe_rope", aligned=True)
    assert max(waits(piped)) >= 2
    assert waits(compile_decode("bf16_pipe_rope", aligned=True, PIPE=False)) == {0}
