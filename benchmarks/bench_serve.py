"""End-to-end numbers through ``banyan serve`` (tokenizer → scheduler → worker over ZMQ, gRPC
streaming to this client): one stream's decode ms/token and time to first token, then N
concurrent streams' output tokens/s.

    python benchmarks/bench_serve.py --model /tmp/llama8b --out serve.json [-- extra serve flags]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]

from tests.support import Server  # noqa: E402
from banyan.bench import datasets  # noqa: E402
from banyan.bench.backends import GrpcBackend  # noqa: E402
from banyan.bench.runner import run as bench_run  # noqa: E402
from shared.config import TokenizerConfig  # noqa: E402
from shared.proto.banyan.v1 import generation_pb2 as pb  # noqa: E402
from shared.proto.banyan.v1 import generation_pb2_grpc as pb_grpc  # noqa: E402


def stream(stub, ids: list[int], n: int) -> tuple[float, list[float]]:
    """-> (seconds to the first token, arrival time of every token)."""
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids),
                             sampling_params=pb.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    t0, arrivals = time.perf_counter(), []
    for resp in stub.Generate(req, timeout=600):
        arrivals += [time.perf_counter()] * len(resp.token_ids)
    return arrivals[0] - t0, arrivals


def load(target: str) -> pb.GetLoadResponse:
    import grpc

    with grpc.insecure_channel(target) as ch:
        return pb_grpc.GenerationServiceStub(ch).GetLoad(pb.GetLoadRequest())


def structured_vs_free(target: str, vocab: int, num: int = 256, concurrency: int = 64,
                       json_only: bool = False) -> dict[str, float]:
    """The same JSON-schema workload constrained and unconstrained (same prompts, same max tokens):
    output tokens/s of each through ``banyan bench``'s client."""
    import asyncio

    constrained = datasets.json_requests(num, 256, 128, vocab)
    free = [dataclasses.replace(r, json_schema="") for r in constrained]
    out: dict[str, float] = {}
    runs = (("free", free), ("json", constrained)) if not json_only else (("json", constrained),)
    for name, reqs in runs:
        async def go(reqs=reqs):
            backend = GrpcBackend(target)
            try:
                return await bench_run(backend, reqs, float("inf"), concurrency, ignore_eos=(name == "free"),
                                       progress=False)
            finally:
                await backend.close()

        before = load(target)
        s = asyncio.run(go())
        after = load(target)
        out[f"{name}_steps"] = after.steps - before.steps
        out[f"{name}_jump_forward_tokens"] = after.jump_forward_tokens - before.jump_forward_tokens
        out[f"{name}_tokens_per_request_step"] = s["total_output_tokens"] / max(1, after.steps - before.steps)
        out[f"{name}_output_tok_s"] = s["output_throughput"]
        out[f"{name}_request_s"] = s["request_throughput"]
        out[f"{name}_failed"] = s["failed"]
        out[f"{name}_mean_output_tokens"] = s["total_output_tokens"] / max(1, s["completed"])
    if not json_only:
        out["json_vs_free_output_tok_s"] = out["json_output_tok_s"] / out["free_output_tok_s"]
        out["json_vs_free_request_s"] = out["json_request_s"] / out["free_request_s"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="/tmp/llama8b")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--log", type=Path, default=Path("/tmp/bench_serve.log"))
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--jump-forward-off-too", action="store_true",
                    help="also run the JSON workload on a server with --disable-jump-forward")
    ap.add_argument("serve_args", nargs="*")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    extra = ["--http-port", "-1"] if "http_port" in {f.name for f in dataclasses.fields(TokenizerConfig)} else []
    server = Server(args.model, args.log, *extra, *args.serve_args)
    res: dict[str, float] = {"startup_s": time.perf_counter() - t0}
    try:
        with server.channel() as ch:
            stub = pb_grpc.GenerationServiceStub(ch)
            vocab = stub.GetModelInfo(pb.GetModelInfoRequest()).vocab_size
            stream(stub, rng.integers(0, vocab, 64).tolist(), 8)  # warm up
            ttft, arrivals = stream(stub, rng.integers(0, vocab, 512).tolist(), 257)
            res["single_ttft_512_ms"] = ttft * 1e3
            res["single_decode_ms_per_token"] = (arrivals[-1] - arrivals[0]) / (len(arrivals) - 1) * 1e3
            n, out_len = args.concurrency, 128
            prompts = [rng.integers(0, vocab, 1024).tolist() for _ in range(n)]
            start = time.perf_counter()
            with ThreadPoolExecutor(n) as pool:
                results = list(pool.map(lambda p: stream(stub, p, out_len), prompts))
            wall = time.perf_counter() - start
            res[f"concurrent{n}_in1024_out{out_len}_output_tok_s"] = n * out_len / wall
            res[f"concurrent{n}_ttft_median_ms"] = statistics.median(r[0] for r in results) * 1e3
            res[f"concurrent{n}_decode_ms_per_token_median"] = statistics.median(
                (a[-1] - a[0]) / (len(a) - 1) * 1e3 for _, a in results)
        res.update(structured_vs_free(server.target, vocab))
    finally:
        server.stop()
    if args.jump_forward_off_too:
        server = Server(args.model, args.log.with_name("serve_nojf.log"), *extra, "--disable-jump-forward",
                        *args.serve_args)
        try:
            off = structured_vs_free(server.target, vocab, json_only=True)
            res.update({f"nojf_{k}": v for k, v in off.items()})
        finally:
            server.stop()
    print(json.dumps(res, indent=1))
    if args.out:
        args.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
