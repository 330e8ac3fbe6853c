"""Worker benchmark (GPU): ``ModelRunner.execute`` on ``ForwardBatch`` messages, the path the
scheduler drives, next to HF transformers (bf16, sdpa) on the same model in the same process.

    python benchmarks/bench_worker.py --model /tmp/llama8b --out results.json

Measures batch-1 decode ms/token, the decode step at batch 64 x 1k context, prefill tokens/s at
1k and 4k prompts (and 8 x 1k in one step), plus per-layer FlashInfer attention variants. Every
step's time is wall clock around ``execute`` (it returns host ids, so the device is synchronized).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.driver import Driver  # noqa: E402
from services.worker.attention.base import AttentionBatch  # noqa: E402
from services.worker.runner import ModelRunner  # noqa: E402
from shared.config import WorkerConfig  # noqa: E402

RNG = np.random.default_rng(0)


def ids(n: int, vocab: int) -> list[int]:
    return RNG.integers(0, vocab, n).tolist()


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn) -> float:
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def bench_ours(model: str, pool: int, decode_steps: int, device: str) -> tuple[dict, ModelRunner, Driver]:
    res: dict[str, float | list | dict] = {}
    t0 = time.perf_counter()
    runner = ModelRunner(WorkerConfig(model=model, device=device, max_total_tokens=pool), model)
    res["startup_s"] = time.perf_counter() - t0
    res["attention"], res["graph_batch_sizes"] = runner.backend, runner.graphs.batch_sizes if runner.graphs else []
    driver, vocab = Driver(runner), runner.spec.vocab_size

    nxt = int(driver.run([("d1", ids(512, vocab), True)])[0])  # batch 1: 512-token prompt, then decode
    steps = []
    for _ in range(decode_steps):
        t = time.perf_counter()
        nxt = int(driver.run([("d1", [nxt], True)])[0])
        steps.append(time.perf_counter() - t)
    res["decode_bs1_ms"] = statistics.median(steps[8:]) * 1e3
    res["decode_bs1_ms_p90"] = float(np.percentile(steps[8:], 90)) * 1e3
    steps, res["decode_bs1_overlap_gpu_idle"] = driver.run_overlapped(["d1"], decode_steps)
    res["decode_bs1_overlap_ms"] = statistics.median(steps[8:]) * 1e3
    if runner.graphs is not None:
        res["decode_bs1_breakdown_ms"] = guarded(lambda: step_breakdown(runner, driver, {"d1": nxt}))
    driver.release("d1")

    for length, reps in ((1024, 6), (4096, 4)):
        times = []
        for r in range(reps):
            times.append(timed(lambda: driver.run([(f"p{length}.{r}", ids(length, vocab), True)])))
            driver.release(f"p{length}.{r}")
        res[f"prefill_{length}_tok_s"] = length / statistics.median(times[1:])

    rids = [f"b{i}" for i in range(64)]
    times, last = [], {}
    for c in range(8):  # 64 prompts of 1024, 8 per step (8192 new tokens)
        chunk = rids[8 * c: 8 * c + 8]
        t = time.perf_counter()
        out = driver.run([(rid, ids(1024, vocab), True) for rid in chunk])
        times.append(time.perf_counter() - t)
        last.update(zip(chunk, out.tolist()))
    res["prefill_8x1024_tok_s"] = 8192 / statistics.median(times[1:])
    steps = []
    for _ in range(48):
        t = time.perf_counter()
        out = driver.run([(rid, [last[rid]], True) for rid in rids])
        steps.append(time.perf_counter() - t)
        last = dict(zip(rids, out.tolist()))
    res["decode_bs64_ctx1k_ms"] = statistics.median(steps[4:]) * 1e3
    steps, res["decode_bs64_overlap_gpu_idle"] = driver.run_overlapped(rids, 48)
    res["decode_bs64_ctx1k_overlap_ms"] = statistics.median(steps[4:]) * 1e3
    if runner.backend == "flashinfer":
        res["attention_layer_us"] = guarded(lambda: attention_variants(runner, driver, rids))
        res["diagnostics"] = guarded(lambda: diagnostics(runner, driver, rids, last))
    return res, runner, driver


@torch.inference_mode()  # the graphs' fixed buffers are inference tensors
def step_breakdown(runner: ModelRunner, driver: Driver, last: dict, n: int = 12) -> dict[str, float]:
    """Median ms of a graph decode step (message built, executed, ids back on the host) and of its
    parts, each timed alone with the device idle before and after: the attention plan, the graph
    replay, sampling. The rest is the host's preparation (table diffs, inputs, message)."""
    rids, parts = list(last), {"step": [], "plan": [], "replay": [], "sample": []}
    bs = runner.graphs.size_for(len(rids))
    params = [runner.params[driver.reqs[r].row] for r in rids]
    for _ in range(n):
        sync()
        t = time.perf_counter()
        out = driver.run([(r, [last[r]], True) for r in rids])
        parts["step"].append(time.perf_counter() - t)
        last = dict(zip(rids, out.tolist()))
        x = runner.graphs.batch(runner.req_to_token, bs, runner.graphs.inputs[4, :bs].tolist())
        parts["plan"].append(timed(lambda: runner.attn.prepare_graph(x, bs)))
        parts["replay"].append(timed(lambda: runner.graphs._graphs[bs].replay()))
        logits = runner.graphs.logits[: len(rids)]
        parts["sample"].append(timed(lambda: runner.sampler.sample(logits, params, [None] * len(rids)).cpu()))
    res = {k: statistics.median(v) * 1e3 for k, v in parts.items()}
    res["rest"] = res["step"] - res["plan"] - res["replay"] - res["sample"]
    return res


def guarded(fn):
    """A diagnostic's result, or its error: diagnostics never cost the benchmark's numbers."""
    try:
        return fn()
    except Exception as e:
        return f"failed: {e!r}"[:400]


def replay_ms(runner: ModelRunner, bs: int, n: int = 20) -> float:
    """GPU time of one decode graph replay (its last plan), host preparation excluded."""
    graph = runner.graphs._graphs[bs]
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / n


def diagnostics(runner: ModelRunner, driver: Driver, rids: list[str], last: dict) -> dict:
    """Where the decode step's time goes: graph replay alone vs the whole step, kernel profile of
    eager steps, and the step with other FlashInfer decode kernels."""
    from services.worker.attention.flashinfer_backend import FlashInferAttention
    from services.worker.cuda_graph import DecodeGraphs

    out: dict = {"replay_ms": {bs: replay_ms(runner, bs) for bs in (1, 8, 64)},
                 "bs64_breakdown_ms": step_breakdown(runner, driver, dict(last))}

    def decode_steps(n: int) -> float:
        nonlocal last
        times = []
        for _ in range(n):
            t = time.perf_counter()
            ids_ = driver.run([(rid, [last[rid]], True) for rid in rids])
            times.append(time.perf_counter() - t)
            last = dict(zip(rids, ids_.tolist()))
        return statistics.median(times[2:]) * 1e3

    graphs, runner.graphs = runner.graphs, None  # eager steps, profiled
    decode_steps(3)
    try:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            decode_steps(3)
        table = prof.key_averages().table(sort_by="device_time_total", row_limit=25, max_name_column_width=70)
        print("eager decode, batch 64, 3 steps:\n" + table, flush=True)
    except Exception as e:  # the profile is a diagnostic, never the benchmark's failure
        print(f"profiler failed: {e!r}", flush=True)
    out["eager_bs64_step_ms"] = decode_steps(6)
    runner.graphs = graphs

    original = runner.attn
    for name, kw in {"tc_fa2": dict(decode_tensor_cores=True), "tc_fa3": dict(decode_tensor_cores=True,
                     decode_backend="fa3"), "cuda_cores": dict(decode_tensor_cores=False)}.items():
        try:
            runner.attn = FlashInferAttention(runner.kv, runner.spec.num_heads, **kw)
            with torch.inference_mode():
                runner.graphs = DecodeGraphs(runner.model, runner.attn, 64, runner.context_length, runner.device,
                                             runner.spec.vocab_size)
            out[f"bs64_step_ms_{name}"] = decode_steps(8)
            out[f"bs64_replay_ms_{name}"] = replay_ms(runner, 64)
        except Exception as e:
            out[f"bs64_step_ms_{name}"] = repr(e)[:300]
    runner.attn, runner.graphs = original, graphs
    return out


def attention_variants(runner: ModelRunner, driver: Driver, rids: list[str]) -> dict[str, float]:
    """One layer of FlashInfer attention on the live pool: decode (64 x ~1k) with and without tensor
    cores, paged prefill (8 x 512 new on 512 cached) with FA3 (auto) and FA2. Median us of 50."""
    from services.worker.attention.flashinfer_backend import FlashInferAttention

    cfg, dev, out = runner.spec, runner.device, {}
    hq = cfg.num_heads

    def batch(rows: list[int], prefix: list[int], extend: list[int]) -> AttentionBatch:
        t = sum(extend)
        return AttentionBatch(req_to_token=runner.req_to_token, rows=torch.tensor(rows, device=dev),
                              prefix_lens=torch.tensor(prefix, device=dev), extend_lens=torch.tensor(extend, device=dev),
                              out_slots=torch.zeros(t, dtype=torch.int64, device=dev),
                              positions=torch.zeros(t, dtype=torch.int64, device=dev),
                              prefix_lens_cpu=prefix, extend_lens_cpu=extend)

    def median_us(attn, b: AttentionBatch) -> float:
        t = sum(b.extend_lens_cpu)
        q = torch.randn(t, hq, cfg.head_dim, dtype=runner.dtype, device=dev)
        k, v = (torch.randn(t, cfg.num_kv_heads, cfg.head_dim, dtype=runner.dtype, device=dev) for _ in range(2))
        attn.prepare(b)
        for _ in range(5):
            attn.forward(q, k, v, 0)
        times = []
        for _ in range(50):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            attn.forward(q, k, v, 0)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        return statistics.median(times)

    rows = [driver.reqs[r].row for r in rids]
    lens = [len(driver.reqs[r].slots) - 1 for r in rids]
    for name, kw in {"tc_fa2": dict(decode_tensor_cores=True), "tc_fa3": dict(decode_tensor_cores=True,
                     decode_backend="fa3"), "cuda_cores": dict(decode_tensor_cores=False)}.items():
        try:
            out[f"decode_64x1k_{name}"] = median_us(FlashInferAttention(runner.kv, hq, **kw),
                                                    batch(rows, lens, [1] * 64))
        except Exception as e:
            out[f"decode_64x1k_{name}"] = repr(e)[:300]
    for backend in ("auto", "fa2"):
        out[f"prefill_8x512_on_512_{backend}"] = median_us(FlashInferAttention(runner.kv, hq, prefill_backend=backend),
                                                           batch(rows[:8], [512] * 8, [512] * 8))
    return out


def bench_hf(model: str, vocab: int) -> dict[str, float]:
    import transformers

    res = {}
    hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16, device_map="cuda",
                                                           attn_implementation="sdpa").eval()

    def gen(batch: int, prompt: int, n: int) -> float:
        x = torch.tensor([ids(prompt, vocab) for _ in range(batch)], device="cuda")
        return timed(lambda: hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                                         do_sample=False, pad_token_id=0))

    gen(1, 16, 4)  # warm up
    res["decode_bs1_ms"] = (gen(1, 512, 65) - gen(1, 512, 1)) / 64 * 1e3
    res["decode_bs64_ctx1k_ms"] = (gen(64, 1024, 17) - gen(64, 1024, 1)) / 16 * 1e3
    with torch.inference_mode():
        for length, reps in ((1024, 4), (4096, 3)):
            x = torch.tensor([ids(length, vocab)], device="cuda")
            times = [timed(lambda: hf(x, logits_to_keep=1)) for _ in range(reps)]
            res[f"prefill_{length}_tok_s"] = length / statistics.median(times[1:])
    del hf
    torch.cuda.empty_cache()
    return res


ROWS = [  # (label, key, unit, goal, better)
    ("batch-1 decode", "decode_bs1_ms", "ms/token", 4.0, "lower"),
    ("batch-1 decode, overlapped steps", "decode_bs1_overlap_ms", "ms/token", 4.0, "lower"),
    ("decode step, batch 64 x 1k ctx", "decode_bs64_ctx1k_ms", "ms", 6.5, "lower"),
    ("  same, overlapped steps", "decode_bs64_ctx1k_overlap_ms", "ms", 6.5, "lower"),
    ("prefill, 1k prompt", "prefill_1024_tok_s", "tok/s", 25000, "higher"),
    ("prefill, 4k prompt", "prefill_4096_tok_s", "tok/s", None, "higher"),
    ("prefill, 8 x 1k in one step", "prefill_8x1024_tok_s", "tok/s", None, "higher"),
]


def table(ours: dict, hf: dict) -> str:
    lines = [f"{'metric':34} {'banyan':>10} {'HF generate':>12} {'goal':>8}  unit", "-" * 78]
    for label, key, unit, goal, _ in ROWS:
        h = f"{hf[key]:12.1f}" if key in hf else f"{'-':>12}"
        g = f"{goal:8g}" if goal else f"{'':8}"
        lines.append(f"{label:34} {ours[key]:10.2f} {h} {g}  {unit}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="/tmp/llama8b")
    ap.add_argument("--out", type=Path, default=None, help="write the results here as JSON")
    ap.add_argument("--pool", type=int, default=140_000, help="KV pool tokens")
    ap.add_argument("--decode-steps", type=int, default=128)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    ours, runner, driver = bench_ours(args.model, args.pool, args.decode_steps, args.device)
    print(json.dumps(ours, indent=1), flush=True)
    vocab = runner.spec.vocab_size
    hf = {} if args.skip_hf else bench_hf(args.model, vocab)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    result = {"date": time.strftime("%Y-%m-%d"), "device": device, "model": args.model,
              "torch": torch.__version__, "banyan": ours, "hf_transformers": hf}
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    print(table(ours, hf), flush=True)


if __name__ == "__main__":
    main()
