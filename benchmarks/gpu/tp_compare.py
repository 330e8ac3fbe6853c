"""Tensor parallelism on one host: the same model served with ``--tp 1`` and ``--tp N`` in one run.

    python -m benchmarks.gpu.tp_compare --model /tmp/llama8b --out D [--tp 1,2] [--w2-num 256]

For each TP size: greedy outputs of 8 prompts (16–512 tokens in, 64 out, with the logprobs of the
chosen tokens and their top 5), W1 (batch-1 decode ms/token) and a W2-shaped offline run (fewer
requests than the suite's W2 to fit one command). Then: greedy outputs identical to TP 1 per
prompt, the largest |logprob difference| of the tokens both chose, and the speed ratios. JSON in
``D/tp_compare.json``; the table is printed last.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT)]

from benchmarks.gpu import suite_workloads as wl  # noqa: E402

LENGTHS = (16, 37, 64, 100, 128, 200, 333, 512)
GREEDY_TOKENS = 64


def greedy(target: str, vocab: int, out_len: int) -> list[dict]:
    import grpc

    from shared.proto.banyan.v1 import generation_pb2 as pb
    from shared.proto.banyan.v1 import generation_pb2_grpc as pb_grpc

    rng, res = random.Random(7), []
    with grpc.insecure_channel(target) as ch:
        stub = pb_grpc.GenerationServiceStub(ch)
        for n in LENGTHS:
            ids = [rng.randrange(100, vocab - 100) for _ in range(n)]
            req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), sampling_params=pb.SamplingParams(
                max_tokens=out_len, temperature=0.0, ignore_eos=True, top_logprobs=5))
            toks, lps = [], []
            for r in stub.Generate(req, timeout=600):
                toks += r.token_ids
                lps += [lp.token.logprob for lp in r.logprobs]
            res.append({"input_len": n, "tokens": toks, "logprobs": lps})
    return res


def run_one(model: str, tp: int, out: Path, sizes: wl.Sizes, extra: list[str]) -> dict:
    from tests.support import Server

    t0 = time.perf_counter()
    server = Server(model, out / f"server_tp{tp}.log", "--tp", str(tp), "--http-port", "-1", *extra)
    res: dict = {"startup_s": time.perf_counter() - t0}
    try:
        vocab = _vocab(server.target)
        wl.warm_up(server.target, vocab, json_too=False)
        res["greedy"] = greedy(server.target, vocab, GREEDY_TOKENS)
        res["W1"] = wl.w1(server.target, sizes, vocab)
        res["W2"] = wl.w2(server.target, sizes, vocab)
    except Exception as e:  # keep what finished
        res["error"] = repr(e)[:2000]
    finally:
        res["exit_code"] = server.stop()
    return res


def _vocab(target: str) -> int:
    import grpc

    from shared.proto.banyan.v1 import generation_pb2 as pb
    from shared.proto.banyan.v1 import generation_pb2_grpc as pb_grpc

    with grpc.insecure_channel(target) as ch:
        return pb_grpc.GenerationServiceStub(ch).GetModelInfo(pb.GetModelInfoRequest()).vocab_size


def compare(results: dict[int, dict]) -> dict:
    base = results[min(results)]
    out = {}
    for tp, r in results.items():
        if tp == min(results) or "greedy" not in r or "greedy" not in base:
            continue
        same = [a["tokens"] == b["tokens"] for a, b in zip(base["greedy"], r["greedy"])]
        diffs = []
        for a, b in zip(base["greedy"], r["greedy"]):
            k = next((i for i, (x, y) in enumerate(zip(a["tokens"], b["tokens"])) if x != y), len(a["tokens"]))
            diffs += [abs(x - y) for x, y in zip(a["logprobs"][:k], b["logprobs"][:k])]
        out[tp] = {"identical_prompts": sum(same), "prompts": len(same), "identical_each": same,
                   "max_abs_logprob_diff": max(diffs) if diffs else None,
                   "w1_ms": r.get("W1", {}).get("ms_per_token"), "w2_output_tok_s": r.get("W2", {}).get("output_throughput")}
    return out


def table(results: dict[int, dict], cmp: dict) -> str:
    lines = ["| | " + " | ".join(f"tp={tp}" for tp in results) + " |", "| --- |" + " ---: |" * len(results)]

    def row(label, f):
        vals = []
        for r in results.values():
            try:
                vals.append(f(r))
            except Exception:
                vals.append("n/a")
        lines.append(f"| {label} | " + " | ".join(vals) + " |")

    row("start-up, s", lambda r: f"{r['startup_s']:.1f}")
    row("W1 batch-1 decode, ms/token", lambda r: f"{r['W1']['ms_per_token']:.2f}")
    row("W2-shaped offline run: output tok/s", lambda r: f"{r['W2']['output_throughput']:,.0f}")
    row("W2-shaped offline run: requests · duration s", lambda r: f"{r['W2']['completed']} · {r['W2']['duration_s']:.1f}")
    for tp, c in cmp.items():
        lines.append(f"\ntp={tp} vs tp={min(results)}: greedy identical on {c['identical_prompts']}/{c['prompts']} prompts "
                     f"({GREEDY_TOKENS} tokens each); max |logprob diff| over the tokens both chose: {c['max_abs_logprob_diff']}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="/tmp/llama8b")
    ap.add_argument("--out", type=Path, default=Path("/tmp/banyan-gpu/tp"))
    ap.add_argument("--tp", default="1,2")
    ap.add_argument("--w1-runs", type=int, default=2)
    ap.add_argument("--w2-num", type=int, default=256)
    ap.add_argument("--greedy-tokens", type=int, default=64)
    ap.add_argument("--length-scale", type=float, default=1.0, help="scale W1/W2 lengths (CPU checks)")
    ap.add_argument("serve_args", nargs="*")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    global GREEDY_TOKENS
    GREEDY_TOKENS = args.greedy_tokens
    ls = args.length_scale
    sizes = wl.Sizes(w1_runs=args.w1_runs, w1_input=max(1, round(128 * ls)), w1_output=max(2, round(256 * ls)),
                     w2_num=args.w2_num, w2_input=(max(1, round(256 * ls)), max(1, round(2048 * ls))),
                     w2_output=(max(1, round(64 * ls)), max(1, round(512 * ls))), hf_subset=0)
    results: dict[int, dict] = {}
    for tp in (int(x) for x in args.tp.split(",")):
        print(f"[tp] tp={tp} ...", flush=True)
        results[tp] = run_one(args.model, tp, args.out, sizes, args.serve_args)
        (args.out / "tp_compare.json").write_text(json.dumps({"results": results}, indent=1))
    cmp = compare(results)
    (args.out / "tp_compare.json").write_text(json.dumps({"results": results, "compare": cmp}, indent=1))
    print(table(results, cmp), flush=True)


if __name__ == "__main__":
    main()
