"""What the small-M linear kernel compiles to, without a GPU: Triton's compiler (and the ptxas it ships)
lowers ``kernels/small_m._linear_kernel`` for a CUDA target (sm_90 by default) with the launch-time
specializations a real call gets (pointers, N, K and strides divisible by 16), and this prints the
instruction mix of the PTX — loads (``cp.async`` pipelined or not, their width), conversions, MMAs,
barriers — and whether the K loop was pipelined. For reading the FP8 weight-only path's bound
(docs/perf.md, 2026-12-03 ninth session) next to ``small_m_bench``'s timings.

    python -m benchmarks.gpu.small_m_ptx --config dot_32x128w4s4k4r --weight fp8 [--arch 90] [--dump DIR]
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[2])]

from services.worker.kernels import small_m as sm  # noqa: E402

ARGS = ("x_ptr", "w_ptr", "s_ptr", "out_ptr", "y_ptr", "cnt_ptr", "M", "N", "K", "k_per_split", "stride_x",
        "stride_w", "stride_out")
INSTR = re.compile(r"\b(cp\.async[\w.]*|ld\.global[\w.]*|ld\.shared[\w.]*|st\.shared[\w.]*|ldmatrix[\w.]*|"
                   r"cvt[\w.]*|mma[\w.]*|wgmma[\w.]*|bar\.sync|fma\.rn[\w.]*)")


def config(name: str) -> sm.Config:
    """A config by its name (``str(Config)``: kind_NxKwWsSkP[r], e.g. dot_32x128w4s4k4r, fma1_8x1024w4s4k1)."""
    m = re.fullmatch(r"(dot|swap|fma(\d+))_(\d+)x(\d+)w(\d+)s(\d+)k(\d+)(r?)(p?)", name)
    if m is None:
        raise SystemExit(f"not a config name: {name!r} (e.g. {', '.join(map(str, sm.CONFIGS[:3]))})")
    kind, rows, bn, bk, w, st, k, r, p = m.groups()
    return sm.Config(int(bn), int(bk), warps=int(w), stages=int(st), split=int(k), m_tile=int(rows or 16),
                     swap=kind == "swap", last_adds=bool(r), prefetch=bool(p))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(sm.CONFIGS[0]))
    ap.add_argument("--weight", choices=("fp8", "bf16"), default="fp8")
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--dump", type=Path, help="write the kernel's TTGIR and PTX here")
    args = ap.parse_args()
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    cfg = config(args.config)
    split = cfg.split > 1
    sig = dict.fromkeys(ARGS[:6], "*bf16") | dict.fromkeys(ARGS[6:], "i32")
    sig |= {"w_ptr": "*fp8e4nv" if args.weight == "fp8" else "*bf16", "s_ptr": "*fp32", "cnt_ptr": "*i32",
            "out_ptr": "*fp32" if split else "*bf16"}
    consts = {"HAS_SCALE": args.weight == "fp8", "USE_DOT": cfg.m_tile == 16, "SWAP": cfg.swap, "PARTIAL": split,
              "LAST_ADDS": cfg.last_adds and split, "SPLIT": cfg.split, "SILU_MUL": False, "BLOCK_M": cfg.m_tile,
              "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k, "PREFETCH": cfg.prefetch and cfg.m_tile < 16}
    sig |= dict.fromkeys(consts, "constexpr")
    aligned = {(ARGS.index(a),): [["tt.divisibility", 16]] for a in ARGS if a != "M"}
    kernel = triton.compile(ASTSource(fn=sm._linear_kernel, signature=sig, constexprs=consts, attrs=aligned),
                            target=GPUTarget("cuda", args.arch, 32),
                            options={"num_warps": cfg.warps, "num_stages": cfg.stages})
    ptx, ttgir = kernel.asm["ptx"], kernel.asm["ttgir"]
    if args.dump:
        args.dump.mkdir(parents=True, exist_ok=True)
        (args.dump / f"{cfg}_{args.weight}.ptx").write_text(ptx)
        (args.dump / f"{cfg}_{args.weight}.ttgir").write_text(ttgir)
    counts = collections.Counter(INSTR.findall(ptx))
    print(f"{cfg} {args.weight} sm_{args.arch}: K loop pipelined (async copies): "
          f"{'yes' if 'async_copy_global_to_local' in ttgir else 'no'} · shared memory "
          f"{kernel.metadata.shared:,} B · {cfg.warps} warps")
    print("| instruction (whole kernel, static) | count |\n| --- | ---: |")
    for name, n in counts.most_common():
        print(f"| `{name}` | {n} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
