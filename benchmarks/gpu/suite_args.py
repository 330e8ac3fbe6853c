"""The GPU suite's command line: its flags (one per workload size, from ``suite_workloads.Sizes``) and the
sizes they make (counts times --scale, lengths times --length-scale, then the flags given)."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from benchmarks.gpu import suite_report as report
from benchmarks.gpu import suite_workloads as wl

COUNTS = ("w2_num", "w3_groups", "w4_num", "w5_num", "w7_duration", "w7_calib_num", "w7_idle_num", "w6_conversations")
LENGTHS = ("w1_input", "w1_output", "w2_input", "w2_output", "w3_system", "w3_question", "w3_output", "w4_input",
           "w4_output", "w7_bg_input", "w7_bg_output", "w7_int_input", "w7_int_output", "w6_system", "w6_user",
           "w6_output", "w6_pool")
TUPLES = ("w5_rates", "w3_extra", "w6_variants", "w7_priority_flags")


def parser(doc: str, workloads: tuple[str, ...], default: tuple[str, ...]) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="", help="HF model dir, built when absent (default /tmp/llama8b; "
                    "--tiny: /tmp/banyan-suite-tiny)")
    ap.add_argument("--tokenizer", type=Path, default=None, help="Llama 3 tokenizer dir (default: "
                    ".assets/llama3, else the team folder's)")
    ap.add_argument("--out", type=Path, default=Path("/tmp/banyan-gpu/suite"))
    ap.add_argument("--tag", default="", help="file name part (default: the workloads, e.g. W1-W2-HF)")
    ap.add_argument("--workloads", default=",".join(default),
                    help=f"subset of {','.join(workloads)} (default {','.join(default)})")
    ap.add_argument("--tiny", action="store_true", help="2-layer hidden-64 model (Llama 3 vocab) on the CPU")
    ap.add_argument("--scale", type=float, default=1.0, help="multiplies the request counts (W2–W5)")
    ap.add_argument("--length-scale", type=float, default=1.0, help="multiplies every input/output length")
    for f in dataclasses.fields(wl.Sizes):
        if f.name.endswith(("_input", "_output")) and isinstance(f.default, tuple):
            ap.add_argument("--" + f.name.replace("_", "-"), type=_range, default=None, help="MIN:MAX tokens")
        elif f.name == "w5_rates":
            ap.add_argument("--w5-rates", default=None, help="req/s list, e.g. 4,8,16; x0.5 = half W2's req/s")
        elif f.name == "w3_extra":
            ap.add_argument("--w3-extra", default=None, help="more shared-prefix shapes GROUPSxPERxSYSTEM, "
                            "comma-separated ('' for none; default 64x16x2048,8x32x8192)")
        elif f.name == "w6_variants":
            ap.add_argument("--w6-variants", default=None, help="W6 servers: off,host,disk (default all three)")
        elif f.name == "w7_priority_flags":
            ap.add_argument("--w7-priority-flags", default=None, help="more `banyan serve` flags for W7's priority-on "
                            "server, comma-separated: --w7-priority-flags=--priority-prefill-cap,512")
        elif isinstance(f.default, float):
            ap.add_argument("--" + f.name.replace("_", "-"), type=float, default=None, help=f"default {f.default}")
        else:
            ap.add_argument("--" + f.name.replace("_", "-"), type=int, default=None, help=f"default {f.default}")
    ap.add_argument("--hf-engines", default="generate,cb", help="HF baselines: generate and/or cb")
    ap.add_argument("--w3-baselines", default="cache_off,cascade_off",
                    help="W3's second servers: cache_off (--disable-radix-cache) and/or cascade_off")
    ap.add_argument("--hf-timeout", type=float, default=420.0, help="seconds for the HF process")
    ap.add_argument("--hbm-bw", type=float, default=report.HBM_BYTES_S, help="bytes/s for the limits")
    ap.add_argument("--peak-flops", type=float, default=report.BF16_FLOP_S, help="FLOP/s for the limits")
    ap.add_argument("--merge", type=Path, nargs="+", default=None, help="suite JSONs to merge into one table")
    ap.add_argument("--step-trace", action="store_true", help="each server's worker writes its step timeline to "
                    "OUT/steps_<server>.jsonl (BANYAN_STEP_TRACE; summary: python -m benchmarks.gpu.step_trace)")
    ap.add_argument("serve_args", nargs="*", help="extra `banyan serve` flags (after --)")
    return ap


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    return int(lo), int(hi or lo)


def sizes_from(args) -> wl.Sizes:
    base, kw = wl.Sizes(), {}
    for f in dataclasses.fields(wl.Sizes):
        v = getattr(base, f.name)
        if f.name in COUNTS:
            v = max(1, round(v * args.scale))
        elif f.name in LENGTHS:
            v = tuple(max(1, round(x * args.length_scale)) for x in v) if isinstance(v, tuple) \
                else max(1, round(v * args.length_scale))
        kw[f.name] = v
    kw["hf_subset"] = min(base.hf_subset, kw["w2_num"])
    if args.tiny:  # (a 2-layer hidden-64 model: 40 GiB of host tier would be ~10^8 of its tokens)
        kw["w6_host_gib"] = kw["w6_disk_gib"] = 0.05
    for f in dataclasses.fields(wl.Sizes):
        given = getattr(args, f.name)
        if given is not None:
            kw[f.name] = tuple(x for x in given.split(",") if x) if f.name in TUPLES else given
    return wl.Sizes(**kw)
