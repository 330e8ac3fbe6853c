"""Two trees' suite runs on the same card, side by side: W1–W4 and the server's start-up, cold and cached.

    python -m benchmarks.gpu.suite_compare BEFORE_DIR AFTER_DIR [--out table.md]

Each DIR holds the suite JSONs one tree's run of ``benchmarks/gpu/calls/gpu.sh`` wrote (``compare`` steps:
``suite_w12_cold.json`` — W1 and W2 from a cold start, no tuning decisions cached, an empty Triton cache —,
``suite_w1_cached.json`` — W1 again, on the decisions and compiles of the first start —, ``suite_w34.json``).
Any file missing leaves its rows empty. "change" is after ÷ before − 1, signed so that + is better (a higher
throughput, a lower ms/token or start-up), and "within 2 %" flags the workloads the issue holds to that.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# (row, file, path in the doc, higher is better)
ROWS = (
    ("W1 batch-1 decode, ms/token", "suite_w12_cold.json", ("results", "W1", "ms_per_token"), False),
    ("W2 output tok/s", "suite_w12_cold.json", ("results", "W2", "output_throughput"), True),
    ("W3 output tok/s, cache on", "suite_w34.json", ("results", "W3", "cache_on", "output_throughput"), True),
    ("W4 output tok/s, constrained", "suite_w34.json", ("results", "W4", "constrained", "output_throughput"), True),
    ("W4 output tok/s, unconstrained", "suite_w34.json", ("results", "W4", "unconstrained", "output_throughput"),
     True),
    ("start-up to ready, s: cold (nothing cached)", "suite_w12_cold.json", ("startup_s", "main", "ready"), False),
    ("start-up to ready, s: cached (an earlier start's decisions)", "suite_w1_cached.json",
     ("startup_s", "main", "ready"), False),
)
HELD = ("W1", "W2", "W3", "W4")  # (within 2 % of the tree before: issue 60)


def _get(doc: dict | None, path: tuple[str, ...]):
    for key in path:
        if not isinstance(doc, dict):
            return None
        doc = doc.get(key)
    return doc if isinstance(doc, (int, float)) else None


def _load(folder: Path, name: str) -> dict | None:
    try:
        return json.loads((folder / name).read_text())
    except (OSError, ValueError):
        return None


def table(before: Path, after: Path) -> str:
    docs = {}
    lines = ["| | before | after | change | |", "| --- | ---: | ---: | ---: | --- |"]
    for label, name, path, higher in ROWS:
        a = _get(docs.setdefault((before, name), _load(before, name)), path)
        b = _get(docs.setdefault((after, name), _load(after, name)), path)
        change, flag = "", ""
        if a and b:
            gain = b / a - 1 if higher else a / b - 1
            change = f"{gain * 100:+.1f} %"
            if label.split()[0] in HELD:
                flag = "within 2 %" if gain >= -0.02 else "**slower than 2 %**"
        lines.append(f"| {label} | {_fmt(a)} | {_fmt(b)} | {change} | {flag} |")
    phases = [_load(d, "suite_w12_cold.json") for d in (before, after)]
    for tag, doc in zip(("before", "after"), phases):
        got = _get_dict(doc, ("startup_s", "main"))
        if got:
            lines.append(f"\ncold start phases, {tag}: " + ", ".join(f"{k} {v}" for k, v in got.items()))
    devices = {(_get_dict(d, ("meta",)) or {}).get("device") for d in phases if d}
    if devices:
        lines.append(f"\ndevice: {' / '.join(sorted(str(d) for d in devices))}")
    return "\n".join(lines)


def _get_dict(doc: dict | None, path: tuple[str, ...]) -> dict | None:
    for key in path:
        doc = doc.get(key) if isinstance(doc, dict) else None
    return doc if isinstance(doc, dict) else None


def _fmt(x) -> str:
    return "" if x is None else f"{x:,.2f}" if x < 100 else f"{x:,.0f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("before", type=Path)
    ap.add_argument("after", type=Path)
    ap.add_argument("--out", type=Path, default=None, help="also write the table here")
    args = ap.parse_args(argv)
    text = table(args.before, args.after)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
