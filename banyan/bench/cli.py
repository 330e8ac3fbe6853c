"""``banyan bench`` command line."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import secrets
import time

from banyan.bench import datasets
from banyan.bench.runner import plot, run, table
from banyan.errors import CommandError
from shared.entry import Parser


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    return int(lo), int(hi or lo)


def parser() -> argparse.ArgumentParser:
    ap = Parser(prog="banyan bench", description="Serving benchmark (Banyan gRPC or OpenAI HTTP)")
    ap.add_argument("--backend", choices=("grpc", "openai"), default="grpc")
    ap.add_argument("--target", default=os.environ.get("BANYAN_ADDRESS", "localhost:50051"),
                    help="gRPC host:port, or the HTTP base URL [env BANYAN_ADDRESS, default localhost:50051]")
    ap.add_argument("--connections", type=int, default=1, help="gRPC: TCP connections to spread the requests over "
                    "(one per client, as many clients would: each lands on one tokenizer replica)")
    ap.add_argument("--stream-interval", type=int, default=1, help="gRPC: tokens per streamed message (the "
                    "first at once; batch clients that do not read token by token: e.g. 8)")
    ap.add_argument("--model", default="", help="model name sent to OpenAI servers (default: the first of /v1/models)")
    ap.add_argument("--api-key", default=os.environ.get("BANYAN_API_KEY", ""))
    ap.add_argument("--dataset", choices=("random", "shared-prefix", "json", "sharegpt", "multiturn"), default="random",
                    help="multiturn: conversations resending their history each turn, closed loop of "
                         "--max-concurrency users (default 32), TTFT by turn, the hit rate next to the most any "
                         "cache could reach (each run salts its requests' cache: earlier runs' do not count); "
                         "gRPC only")
    ap.add_argument("--dataset-path", default="", help="ShareGPT-format JSON file (--dataset sharegpt)")
    ap.add_argument("--num-prompts", type=int, default=200)
    ap.add_argument("--input-len", type=_range, default=(256, 1024), help="MIN:MAX tokens (random/json)")
    ap.add_argument("--output-len", type=_range, default=(64, 256), help="MIN:MAX tokens")
    ap.add_argument("--groups", type=int, default=8, help="shared-prefix: groups")
    ap.add_argument("--prompts-per-group", type=int, default=16)
    ap.add_argument("--system-prompt-len", type=int, default=1024)
    ap.add_argument("--question-len", type=int, default=128)
    ap.add_argument("--conversations", type=int, default=64, help="multiturn: conversations (one system prompt)")
    ap.add_argument("--turns", type=int, default=8, help="multiturn: turns per conversation")
    ap.add_argument("--user-len", type=_range, default=(256, 256), help="multiturn: MIN:MAX tokens of a user message")
    ap.add_argument("--vocab-size", type=int, default=0,
                    help="token-id range of random prompts (0: ask the server: gRPC GetModelInfo, or vocab_size in "
                         "an OpenAI-compatible server's /v1/models, which Banyan reports)")
    ap.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (Poisson); inf = all at once")
    ap.add_argument("--max-concurrency", type=int, default=0, help="0 = unlimited")
    ap.add_argument("--priority", type=int, default=0,
                    help="the requests' priority (higher = more urgent; served with --enable-priority-scheduling)")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--no-ignore-eos", action="store_true", help="let requests end at EOS")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output-json", "--out", dest="out", default="",
                    help="JSON results (the PNG plots are written beside it; default: bench-YYYYMMDD-HHMMSS.json "
                         "here, a new name each run)")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--save-token-times", action="store_true", help="also write each request's token arrival times "
                    "(Unix seconds, token_epochs) to the JSON: to line up with the server's step trace "
                    "(python -m benchmarks.gpu.itl_trace)")
    return ap


def _server_models(args) -> list[dict]:
    """``GET /v1/models`` of an OpenAI-compatible server (Banyan's cards carry ``vocab_size``)."""
    import urllib.request

    req = urllib.request.Request(args.target.rstrip("/") + "/v1/models",
                                 headers={"Authorization": f"Bearer {args.api_key}"} if args.api_key else {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read()).get("data") or []
    except Exception as e:  # noqa: BLE001 — the server's own error is clearer than a traceback
        raise CommandError(f"GET {req.full_url} failed: {getattr(e, 'reason', None) or e}: is the server running "
                           "there? (--target)") from e


def _vocab(args) -> int:
    """The token-id range of random prompts: --vocab-size, else the server's vocabulary (gRPC
    GetModelInfo; over HTTP Banyan's ``vocab_size`` in /v1/models)."""
    if args.vocab_size:
        return args.vocab_size
    if args.backend == "grpc":
        import grpc

        from shared.proto.banyan.v1 import generation_pb2 as pb
        from shared.proto.banyan.v1 import generation_pb2_grpc as pb_grpc

        meta = [("authorization", f"Bearer {args.api_key}")] if args.api_key else None
        with grpc.insecure_channel(args.target) as ch:
            return pb_grpc.GenerationServiceStub(ch).GetModelInfo(pb.GetModelInfoRequest(), timeout=30,
                                                                  metadata=meta).vocab_size
    cards = _server_models(args)
    card = next((c for c in cards if c.get("id") == args.model), cards[0] if cards else {})
    if not card.get("vocab_size"):
        raise CommandError(f"{args.target} does not report its vocabulary size (no vocab_size in "
                         "/v1/models): pass --vocab-size N for random token-id prompts")
    return int(card["vocab_size"])


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
        raise CommandError("--dataset sharegpt needs --dataset-path")
    return datasets.sharegpt_requests(args.dataset_path, args.num_prompts, args.output_len[1], args.seed)


async def _main(args) -> dict:
    from banyan.bench.backends import GrpcBackend, OpenAIBackend

    if args.dataset == "multiturn":
        from banyan.bench.multiturn import run_multiturn

        convs = datasets.multiturn_conversations(args.conversations, args.turns, args.system_prompt_len, args.user_len,
                                                 args.output_len, _vocab(args), args.seed)
        backend = GrpcBackend(args.target, cache_salt=f"bench-{secrets.token_hex(8)}")  # this run's reuse only
        try:
            return await run_multiturn(backend, convs, args.max_concurrency or 32, args.temperature,
                                       progress=not args.no_progress)
        finally:
            await backend.close()
    requests = build_requests(args)
    if args.priority:
        requests = [dataclasses.replace(r, priority=args.priority) for r in requests]
    backend = (GrpcBackend(args.target, args.connections, args.stream_interval) if args.backend == "grpc"
               else OpenAIBackend(args.target, args.model, args.api_key))
    try:
        return await run(backend, requests, args.request_rate, args.max_concurrency,
                         ignore_eos=not args.no_ignore_eos, temperature=args.temperature, seed=args.seed,
                         progress=not args.no_progress, token_epochs=args.save_token_times)
    finally:
        await backend.close()


def default_out(now: float | None = None) -> str:
    """``bench-YYYYMMDD-HHMMSS.json`` in the current directory (``-2``, ``-3`` … when taken): a run never
    overwrites an earlier one unless ``--out`` names it."""
    stem = time.strftime("bench-%Y%m%d-%H%M%S", time.localtime(now))
    path, k = f"{stem}.json", 1
    while os.path.exists(path):
        k += 1
        path = f"{stem}-{k}.json"
    return path


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    if args.connections < 1 or args.stream_interval < 1:
        ap.error("--connections and --stream-interval must be >= 1")
    if args.dataset == "multiturn" and args.backend != "grpc":
        ap.error("--dataset multiturn needs --backend grpc (each turn's history carries the answer's token ids)")
    if args.backend == "openai" and not args.model:
        args.model = next((c.get("id", "") for c in _server_models(args)), "")
    summary = asyncio.run(_main(args))
    if summary["failed"] and not summary["completed"]:  # nothing to measure: say why, in one line
        raise CommandError(f"all {summary['failed']} requests failed: {'; '.join(summary['errors'])}")
    args.out = args.out or default_out()
    summary["config"] = {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(args).items()
                         if k != "api_key"}
    summary["config"]["request_rate"] = str(args.request_rate)
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=1)
    png = os.path.splitext(args.out)[0] + ".png"
    drew = plot(summary, png)
    print(table(summary))
    print(f"results: {args.out}" + (f", {png}" if drew else ""))
    if not drew:
        print("no plots: matplotlib is not installed (pip install matplotlib, or the bench extra: "
              "pip install -e '.[bench]')")
    return 0 if summary["failed"] == 0 else 1
