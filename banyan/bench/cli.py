"""``banyan bench`` command line."""

from __future__ import annotations

import argparse
import asyncio
import json
import os

from banyan.bench import datasets
from banyan.bench.runner import plot, run, table


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    return int(lo), int(hi or lo)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="banyan bench", description="Serving benchmark (Banyan gRPC or OpenAI HTTP)")
    ap.add_argument("--backend", choices=("grpc", "openai"), default="grpc")
    ap.add_argument("--target", default="localhost:50051", help="gRPC host:port, or the HTTP base URL")
    ap.add_argument("--model", default="", help="model name sent to OpenAI servers")
    ap.add_argument("--api-key", default=os.environ.get("BANYAN_API_KEY", ""))
    ap.add_argument("--dataset", choices=("random", "shared-prefix", "json", "sharegpt"), default="random")
    ap.add_argument("--dataset-path", default="", help="ShareGPT-format JSON file (--dataset sharegpt)")
    ap.add_argument("--num-prompts", type=int, default=200)
    ap.add_argument("--input-len", type=_range, default=(256, 1024), help="MIN:MAX tokens (random/json)")
    ap.add_argument("--output-len", type=_range, default=(64, 256), help="MIN:MAX tokens")
    ap.add_argument("--groups", type=int, default=8, help="shared-prefix: groups")
    ap.add_argument("--prompts-per-group", type=int, default=16)
    ap.add_argument("--system-prompt-len", type=int, default=1024)
    ap.add_argument("--question-len", type=int, default=128)
    ap.add_argument("--vocab-size", type=int, default=0, help="token-id range for random prompts (0: ask the server)")
    ap.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (Poisson); inf = all at once")
    ap.add_argument("--max-concurrency", type=int, default=0, help="0 = unlimited")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--no-ignore-eos", action="store_true", help="let requests end at EOS")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output-json", "--out", dest="out", default="bench-result.json",
                    help="JSON results (the PNG plots are written beside it)")
    ap.add_argument("--no-progress", action="store_true")
    return ap


def _vocab(args) -> int:
    if args.vocab_size:
        return args.vocab_size
    if args.backend == "grpc":
        import grpc

        from shared.proto.banyan.v1 import generation_pb2 as pb
        from shared.proto.banyan.v1 import generation_pb2_grpc as pb_grpc

        with grpc.insecure_channel(args.target) as ch:
            return pb_grpc.GenerationServiceStub(ch).GetModelInfo(pb.GetModelInfoRequest(), timeout=30).vocab_size
    return 32000


def build_requests(args) -> list[datasets.BenchRequest]:
    vocab = _vocab(args) if args.dataset != "sharegpt" else 0
    if args.dataset == "random":
        return datasets.random_requests(args.num_prompts, args.input_len, args.output_len, vocab, args.seed)
    if args.dataset == "shared-prefix":
        return datasets.shared_prefix_requests(args.groups, args.prompts_per_group, args.system_prompt_len,
                                               args.question_len, args.output_len[1], vocab, args.seed)
    if args.dataset == "json":
        return datasets.json_requests(args.num_prompts, args.input_len[1], args.output_len[1], vocab, args.seed)
    if not args.dataset_path:
        raise SystemExit("--dataset sharegpt needs --dataset-path")
    return datasets.sharegpt_requests(args.dataset_path, args.num_prompts, args.output_len[1], args.seed)


async def _main(args) -> dict:
    from banyan.bench.backends import GrpcBackend, OpenAIBackend

    requests = build_requests(args)
    backend = (GrpcBackend(args.target) if args.backend == "grpc"
               else OpenAIBackend(args.target, args.model, args.api_key))
    try:
        return await run(backend, requests, args.request_rate, args.max_concurrency,
                         ignore_eos=not args.no_ignore_eos, temperature=args.temperature, seed=args.seed,
                         progress=not args.no_progress)
    finally:
        await backend.close()


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    summary = asyncio.run(_main(args))
    summary["config"] = {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(args).items()
                         if k != "api_key"}
    summary["config"]["request_rate"] = str(args.request_rate)
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=1)
    png = os.path.splitext(args.out)[0] + ".png"
    drew = plot(summary, png)
    print(table(summary))
    print(f"results: {args.out}" + (f", {png}" if drew else ""))
    return 0 if summary["failed"] == 0 else 1
