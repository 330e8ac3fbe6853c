"""The decode knob sweeps (call steps ``bknob``, ``bknob@w``, ``fknob``) as one table: for each batch × context,
every configuration's µs a layer beside FlashInfer's and the served launch's, the fastest marked, and its gain.

    python -m benchmarks.gpu.knob_table RESULTS_DIR            # reads bknob*_*.json and fknob_*.json there
    python -m benchmarks.gpu.knob_table RESULTS_DIR --json out.json

``bknob_<block>_<warps>_<stages>_<pipe>.json`` hold ``fp8_decode_bench --only bf16_served --splits 1,2`` rows run
with those knobs (``BANYAN_DECODE_BLOCK`` / ``_WARPS`` / ``_STAGES`` / ``_PIPE``); the baseline is the served
configuration of the run with the served knobs (``64_4_2_0``). ``fknob_<pipe>.json`` hold the FP8 pool's served
decode and its 32–128-token block configurations with the knob off (0) and on (1).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

SERVED = "64_4_2_0"  # (block 64, 4 warps, 2 stages, no pipe: the bf16 launch as served on 2026-12-05)
BF16 = re.compile(r"^triton_bf16_served_(\d+)splits_min0_us$")
FP8 = re.compile(r"^triton_fp8_(served|served_rope|\d+_\dw\ds_f16_asm)_us$")


def collect(folder: Path) -> dict[tuple[int, int], dict[str, float]]:
    """{(batch, context): {configuration: µs a layer}}, FlashInfer's as ``flashinfer_bf16`` / ``flashinfer_fp8`` (from
    the served knobs' run where there is one)."""
    table: dict[tuple[int, int], dict[str, float]] = {}
    first = lambda p: (not (p.stem.endswith("_" + SERVED) or p.stem == "fknob_0"), p.name)  # noqa: E731
    for path in sorted(folder.glob("bknob*_*.json"), key=first) + sorted(folder.glob("fknob_*.json"), key=first):
        knob = path.stem.split("_", 1)[1].removeprefix("w_")  # (bknob_w_64_4_2_0 → 64_4_2_0)
        for row in json.loads(path.read_text())["rows"]:
            cell = table.setdefault((row["batch"], row["context"]), {})
            for key, us in row.items():
                if not isinstance(us, (int, float)) or isinstance(us, bool):
                    continue
                if key in ("flashinfer_bf16_us", "flashinfer_fp8_us"):
                    cell.setdefault(key.removesuffix("_us"), float(us))
                elif m := BF16.match(key):
                    cell[f"bf16 {knob} s{m.group(1)}"] = float(us)
                elif path.stem.startswith("fknob") and (m := FP8.match(key)):
                    cell[f"fp8 {m.group(1)} pipe{knob}"] = float(us)
    return table


def summary(table: dict[tuple[int, int], dict[str, float]]) -> list[dict]:
    """A row a shape and pool: the served time, the fastest configuration, its time and its gain over served."""
    out = []
    for (batch, ctx), cell in sorted(table.items()):
        for pool, served in (("bf16", [f"bf16 {SERVED} s1", f"bf16 {SERVED} s2"]), ("fp8", ["fp8 served pipe0"])):
            mine = {k: v for k, v in cell.items() if k.startswith(pool + " ")}
            base = [cell[k] for k in served if k in cell]
            if not mine or not base:
                continue
            best = min(mine, key=mine.get)
            out.append({"batch": batch, "context": ctx, "pool": pool, "flashinfer": cell.get(f"flashinfer_{pool}"),
                        "served_best_split": min(base), "best": best, "best_us": mine[best],
                        "gain": round(1 - mine[best] / min(base), 4), "all": mine})
    return out


def markdown(rows: list[dict]) -> str:
    lines = ["| batch × context | pool | FlashInfer | served (best split) | fastest | µs | gain |",
             "| --- | --- | ---: | ---: | --- | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['batch']} × {r['context']} | {r['pool']} | {r['flashinfer']} | {r['served_best_split']} "
                     f"| `{r['best']}` | {r['best_us']} | {r['gain']:+.1%} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    rows = summary(collect(a.folder))
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))
    print(markdown(rows))


if __name__ == "__main__":
    main()
