"""The suite's workloads (W1–W5, W7) against a live ``banyan serve`` (gRPC), and the request sets they
share with the HF baselines. Every request set is a pure function of the sizes and a seed, so two
invocations (and the HF process) build the same requests.

No two timed runs share a prompt: the radix cache would serve the second one's prefill. Where a
run must repeat a workload's shape (the HF subset on Banyan, the unconstrained W4 twin), it gets
fresh token ids of the same lengths (``same_lengths``): random weights make the ids irrelevant to
the cost.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import statistics
import time
from dataclasses import dataclass

from banyan.bench import datasets
from banyan.bench.backends import GrpcBackend, Result
from banyan.bench.datasets import BenchRequest
from banyan.bench.runner import run as bench_run

# seeds of the request sets (distinct: no set shares a prompt with another)
SEED_W1, SEED_W2, SEED_W2_SUBSET, SEED_W3, SEED_W4, SEED_W4_TWIN, SEED_W5, SEED_WARMUP = range(100, 108)
SEED_W6 = 108


@dataclass(frozen=True)
class Sizes:
    """Workload sizes after ``--scale`` / ``--length-scale`` and the per-workload flags."""

    w1_runs: int = 3
    w1_input: int = 128
    w1_output: int = 256
    w2_num: int = 1024
    w2_input: tuple[int, int] = (256, 2048)
    w2_output: tuple[int, int] = (64, 512)
    w3_groups: int = 32
    w3_per_group: int = 32
    w3_system: int = 2048
    w3_question: int = 128
    w3_output: int = 256
    w4_num: int = 256
    w4_input: int = 256
    w4_output: int = 128
    w4_concurrency: int = 64
    w4_b1_num: int = 16  # the first W4 requests again one at a time (batch-1 JSON overhead); 0: not run
    w5_num: int = 200
    w5_rates: tuple[str, ...] = ("4", "8", "16")  # req/s, or "x0.5": that fraction of W2's req/s
    # more shared-prefix shapes (groups x per group x system; question and output as W3), cascade on and
    # off: SGLang's generated-shared-prefix default and a long document
    w3_extra: tuple[str, ...] = ("64x16x2048", "8x32x8192")
    hf_subset: int = 32
    hf_batch: int = 32
    hf_w1_runs: int = 1
    # W7, priority: background batch traffic at w7_load x capacity (priority 0, long outputs) for
    # w7_duration seconds, with interactive requests at w7_rate req/s (priority 10) alongside
    w7_duration: int = 45
    w7_load: float = 1.5
    w7_rate: float = 2.0
    w7_bg_input: int = 512
    w7_bg_output: int = 1024
    w7_int_input: int = 512
    w7_int_output: int = 64
    w7_calib_num: int = 384  # background requests sent at once to measure capacity (req/s)
    w7_idle_num: int = 20  # interactive requests on the idle server (the idle TTFT / ITL)
    w7_connections: int = 1  # the background client's gRPC connections (with --num-tokenizers N: spread over them)
    w7_bg_stream_interval: int = 1  # the background's tokens per streamed message (batch clients need not stream)
    w7_priority_flags: tuple[str, ...] = ()  # more `banyan serve` flags for the priority-on server
    # W6 multi-turn (suite_w6.py): conversations x turns, system prompt, user message and answer per turn, users
    # at once; the KV pool of its servers (--max-total-tokens), their host tier and disk tier (GiB per rank)
    w6_conversations: int = 64
    w6_turns: int = 8
    w6_system: int = 2048
    w6_user: int = 256
    w6_output: int = 128
    w6_concurrency: int = 32
    w6_pool: int = 60000
    w6_host_gib: float = 40.0
    w6_disk_gib: float = 40.0
    w6_variants: tuple[str, ...] = ("off", "host", "disk")  # GPU pool only; + host tier; + disk, then a restart

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, int) and v < (0 if f.name in ("hf_subset", "w4_concurrency", "w4_b1_num") else 1):
                raise ValueError(f"{f.name} must be positive, got {v}")
        for lo, hi in (self.w2_input, self.w2_output):
            if not 1 <= lo <= hi:
                raise ValueError(f"bad length range {lo}..{hi}")
        for v in self.w6_variants:
            if v not in ("off", "host", "disk"):
                raise ValueError(f"--w6-variants: {v!r} is not off, host or disk")
        for r in self.w5_rates:
            if float(r.removeprefix("x")) <= 0:
                raise ValueError(f"--w5-rates: {r!r} is not a positive rate")
        for shape in self.w3_extra:
            parse_shape(shape)
        if not (self.w7_load > 0 and self.w7_rate > 0):
            raise ValueError("w7_load and w7_rate must be positive")

    @property
    def w3_optimum_hit_rate(self) -> float:
        """Prompt tokens a perfect prefix cache serves: every group's system prompt but the first."""
        shareable = (self.w3_groups * self.w3_per_group - self.w3_groups) * self.w3_system
        return shareable / (self.w3_groups * self.w3_per_group * (self.w3_system + self.w3_question))


def w1_prompts(s: Sizes, vocab: int) -> list[list[int]]:
    return [r.prompt_ids for r in datasets.random_requests(s.w1_runs, (s.w1_input,) * 2, (1, 1), vocab, SEED_W1)]


def w2_requests(s: Sizes, vocab: int) -> list[BenchRequest]:
    return datasets.random_requests(s.w2_num, s.w2_input, s.w2_output, vocab, SEED_W2)


def w3_requests(s: Sizes, vocab: int) -> list[BenchRequest]:
    return datasets.shared_prefix_requests(s.w3_groups, s.w3_per_group, s.w3_system, s.w3_question, s.w3_output,
                                           vocab, SEED_W3)


def parse_shape(shape: str) -> tuple[int, int, int]:
    """"GxPxS" → (groups, per group, system tokens)."""
    try:
        g, p, sys_len = (int(x) for x in shape.split("x"))
    except ValueError:
        raise ValueError(f"--w3-extra: {shape!r} is not GROUPSxPERxSYSTEM") from None
    if min(g, p, sys_len) < 1:
        raise ValueError(f"--w3-extra: {shape!r} has a size below 1")
    return g, p, sys_len


def w3_shape(target: str, s: Sizes, vocab: int, shape: str) -> dict:
    """Another shared-prefix shape, like W3 (fresh prompts: its own seed)."""
    g, p, sys_len = parse_shape(shape)
    sized = dataclasses.replace(s, w3_groups=g, w3_per_group=p, w3_system=sys_len)
    reqs = datasets.shared_prefix_requests(g, p, sys_len, s.w3_question, s.w3_output, vocab, SEED_W3 + 1000 + g * p)
    summary, _ = serve_run(target, reqs)
    return {**brief(summary), "first_output_s": min(summary["ttfts_s"], default=0.0),
            "optimum_hit_rate": sized.w3_optimum_hit_rate,
            "hit_vs_optimum": summary["cache_hit_rate"] / sized.w3_optimum_hit_rate}


def w5_requests(s: Sizes, vocab: int, i: int) -> list[BenchRequest]:
    return datasets.random_requests(s.w5_num, s.w2_input, s.w2_output, vocab, SEED_W5 + 17 * i)


def same_lengths(reqs: list[BenchRequest], vocab: int, seed: int, output_lens: list[int] | None = None,
                 schema: bool = False) -> list[BenchRequest]:
    """Fresh prompts of the same lengths (and the given output lengths), optionally keeping the schema."""
    rng = random.Random(seed)
    lo, hi = min(1000, vocab // 4), vocab - 1
    outs = output_lens or [r.output_len for r in reqs]
    return [BenchRequest(prompt_ids=[rng.randrange(lo, hi) for _ in range(r.prompt_len)], output_len=n,
                         json_schema=r.json_schema if schema else "") for r, n in zip(reqs, outs)]


class Recording:
    """A backend that keeps every request's ``Result`` (by the request object's identity)."""

    def __init__(self, backend: GrpcBackend) -> None:
        self.backend = backend
        self.results: dict[int, Result] = {}

    async def send(self, r: BenchRequest, ignore_eos: bool, temperature: float, progress=None) -> Result:
        res = await self.backend.send(r, ignore_eos, temperature, progress)
        self.results[id(r)] = res
        return res


def serve_run(target: str, reqs: list[BenchRequest], rate: float = float("inf"), concurrency: int = 0,
              ignore_eos: bool = True) -> tuple[dict, list[Result]]:
    """``banyan bench``'s runner over gRPC: (summary, per-request results in request order)."""
    async def go() -> tuple[dict, list[Result]]:
        rec = Recording(GrpcBackend(target))
        try:
            summary = await bench_run(rec, reqs, rate, concurrency, ignore_eos=ignore_eos, progress=False)
        finally:
            await rec.backend.close()
        return summary, [rec.results[id(r)] for r in reqs]

    return asyncio.run(go())


def brief(summary: dict) -> dict:
    """A run's summary without the per-request lists."""
    return {k: v for k, v in summary.items() if k not in ("latencies_s", "ttfts_s")}


def get_load(target: str):
    import grpc

    from shared.proto.banyan.v1 import generation_pb2 as pb
    from shared.proto.banyan.v1 import generation_pb2_grpc as pb_grpc

    with grpc.insecure_channel(target) as ch:
        return pb_grpc.GenerationServiceStub(ch).GetLoad(pb.GetLoadRequest(), timeout=30)


def load_delta(before, after) -> dict:
    """Counters of GetLoad accumulated between two calls."""
    return {k: getattr(after, k) - getattr(before, k)
            for k in ("steps", "prefill_computed_tokens", "prefill_cached_tokens", "decode_tokens", "retractions",
                      "evicted_tokens", "jump_forward_tokens")}


def warm_up(target: str, vocab: int, json_too: bool) -> None:
    reqs = datasets.random_requests(8, (32, 64), (8, 8), vocab, SEED_WARMUP)
    if json_too:
        reqs += datasets.json_requests(2, 32, 32, vocab, SEED_WARMUP)
    serve_run(target, reqs)


def w1(target: str, s: Sizes, vocab: int) -> dict:
    """Batch-1 decode, one stream at a time: the median gap between token arrivals (a response of k
    tokens counts as k gaps of 1/k of its gap), the mean over each run, and time to first token."""
    import grpc

    from shared.proto.banyan.v1 import generation_pb2 as pb
    from shared.proto.banyan.v1 import generation_pb2_grpc as pb_grpc

    ttfts, gaps, means = [], [], []
    with grpc.insecure_channel(target) as ch:
        stub = pb_grpc.GenerationServiceStub(ch)
        for ids in w1_prompts(s, vocab):
            req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), sampling_params=pb.SamplingParams(
                max_tokens=s.w1_output, temperature=0.0, ignore_eos=True))
            t0 = time.perf_counter()
            chunks = [(time.perf_counter(), len(r.token_ids)) for r in stub.Generate(req, timeout=600) if r.token_ids]
            ttfts.append(chunks[0][0] - t0)
            n = sum(k for _, k in chunks)
            means.append((chunks[-1][0] - chunks[0][0]) / max(1, n - chunks[0][1]))
            for (a, _), (b, k) in zip(chunks, chunks[1:]):
                gaps += [(b - a) / k] * k
    return {"ms_per_token": statistics.median(gaps) * 1e3, "ms_per_token_mean": statistics.fmean(means) * 1e3,
            "ms_per_token_runs": [m * 1e3 for m in means], "ttft_ms": statistics.median(ttfts) * 1e3,
            "ttft_ms_runs": [t * 1e3 for t in ttfts], "runs": len(ttfts), "input_len": s.w1_input,
            "output_len": s.w1_output}


def w2(target: str, s: Sizes, vocab: int) -> dict:
    """Offline: every request at once. Then the HF subset's shape (same lengths, fresh ids) alone,
    for a like-for-like comparison with the HF baselines."""
    reqs = w2_requests(s, vocab)
    before = get_load(target)
    summary, _ = serve_run(target, reqs)
    out = {**brief(summary), "load": load_delta(before, get_load(target)),
           "total_tok_s": (summary["total_input_tokens"] + summary["total_output_tokens"]) / summary["duration_s"]}
    if s.hf_subset:
        sub, _ = serve_run(target, same_lengths(reqs[:s.hf_subset], vocab, SEED_W2_SUBSET))
        out["subset"] = {"requests": sub["completed"], "failed": sub["failed"], "duration_s": sub["duration_s"],
                         "output_tok_s": sub["output_throughput"]}
    return out


def w3(target: str, s: Sizes, vocab: int) -> dict:
    """Shared prefix, all at once; hit rate from the responses' usage and from the engine's counters."""
    reqs = w3_requests(s, vocab)
    before = get_load(target)
    summary, _ = serve_run(target, reqs)
    load = load_delta(before, get_load(target))
    prompt = load["prefill_cached_tokens"] + load["prefill_computed_tokens"]
    return {**brief(summary), "load": load, "first_output_s": min(summary["ttfts_s"], default=0.0),
            "engine_hit_rate": load["prefill_cached_tokens"] / prompt if prompt else 0.0,
            "optimum_hit_rate": s.w3_optimum_hit_rate,
            "hit_vs_optimum": summary["cache_hit_rate"] / s.w3_optimum_hit_rate}


def w4(target: str, s: Sizes, vocab: int) -> dict:
    """JSON schema, then the unconstrained twin: fresh prompts of the same lengths, each with
    max_tokens = what its constrained run produced and EOS ignored, so only the constraint differs."""
    reqs = datasets.json_requests(s.w4_num, s.w4_input, s.w4_output, vocab, SEED_W4)
    out = {}
    before = get_load(target)
    summary, results = serve_run(target, reqs, concurrency=s.w4_concurrency, ignore_eos=False)
    out["constrained"] = {**brief(summary), "load": load_delta(before, get_load(target))}
    produced = [max(1, r.output_len) for r in results]
    twin = same_lengths(reqs, vocab, SEED_W4_TWIN, produced)
    before = get_load(target)
    summary, results = serve_run(target, twin, concurrency=s.w4_concurrency, ignore_eos=True)
    out["unconstrained"] = {**brief(summary), "load": load_delta(before, get_load(target))}
    out["same_lengths"] = [r.output_len for r in results] == produced
    c, u = out["constrained"], out["unconstrained"]
    out["ratio"] = c["output_throughput"] / u["output_throughput"] if u["output_throughput"] else 0.0
    out["jump_forward_tokens"] = c["load"]["jump_forward_tokens"]
    out["mean_output_tokens"] = statistics.fmean(produced)
    if s.w4_b1_num:  # batch 1: the first requests one at a time, constrained then their twins
        k = min(s.w4_b1_num, len(reqs))
        con, _ = serve_run(target, reqs[:k], concurrency=1, ignore_eos=False)
        unc, _ = serve_run(target, twin[:k], concurrency=1, ignore_eos=True)
        out["batch1"] = {"requests": k, "constrained": brief(con), "unconstrained": brief(unc)}
        cb, ub = (x["output_throughput"] for x in (out["batch1"]["constrained"], out["batch1"]["unconstrained"]))
        out["batch1"]["overhead"] = ub / cb - 1 if cb else None  # time per output token, constrained ÷ not − 1
    return out


def w5(target: str, s: Sizes, vocab: int, w2_req_s: float | None) -> dict:
    """Poisson arrivals at each rate (``x0.5``: half of W2's request throughput)."""
    out = {"rates": []}
    for i, spec in enumerate(s.w5_rates):
        if spec.startswith("x"):
            if not w2_req_s:
                raise ValueError(f"--w5-rates {spec}: a fraction of W2's throughput needs W2 in the same run")
            rate = float(spec[1:]) * w2_req_s
        else:
            rate = float(spec)
        summary, _ = serve_run(target, w5_requests(s, vocab, i), rate=rate)
        out["rates"].append({"rate": rate, "spec": spec, **brief(summary)})
    return out


# ---------------------------------------------------------------- W7: priority scheduling
