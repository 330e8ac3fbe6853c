"""HF transformers baselines of the GPU suite, in a process of their own (the suite runs this
before it starts ``banyan serve``, so the GPU is empty again when the server sizes its KV pool).

    python -m benchmarks.gpu.hf_baselines --model /tmp/llama8b --requests reqs.json --out hf.json

``reqs.json`` (written by ``benchmarks/gpu/suite.py``): ``{"w1": {"prompts": [[ids]], "output_len": N},
"w2": [{"prompt_ids": [ids], "output_len": N}, ...]}`` — the W1 prompts and the W2 subset.

Two engines on the same weights (bf16 and sdpa on CUDA; fp32 on CPU), greedy, EOS ignored:

- ``generate``: W1 at batch 1 (token arrival times from a streamer), and the W2 subset in static
  batches padded on the left; a batch runs to its longest output, so only the requested tokens
  count as output (``generated_tokens`` counts the padding work too).
- continuous batching (``ContinuousBatchingManager``, paged KV cache, transformers >= 5): W1 one
  request at a time, the W2 subset all at once with each request's own ``max_new_tokens``. The
  manager's warm-up (graph capture) happens before the clock starts, as the server's does.

Each engine's result, or its error, is recorded: a failing baseline never costs the other one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import traceback
from pathlib import Path

import torch

CPU_BLOCK_TOKENS = 256  # the continuous-batching cache's page size (transformers' default)
CPU_MAX_BATCH_TOKENS = 512  # tokens per continuous-batching step on the CPU (both given: no memory-based solve)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def load(model: str, device: str):
    import transformers

    cuda = device.startswith("cuda")
    kw = {"device_map": device} if cuda else {}  # loads straight onto the GPU (needs accelerate, as there)
    return transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16 if cuda else torch.float32,
                                                             attn_implementation="sdpa", **kw).eval()


def _latency(ttfts: list[float], gaps: list[float]) -> dict:
    return {"ms_per_token": statistics.median(gaps) * 1e3 if gaps else 0.0,
            "ms_per_token_mean": statistics.fmean(gaps) * 1e3 if gaps else 0.0,
            "ttft_ms": statistics.median(ttfts) * 1e3 if ttfts else 0.0,
            "ttft_ms_runs": [t * 1e3 for t in ttfts], "runs": len(ttfts)}


def generate_w1(hf, prompts: list[list[int]], n: int, device: str) -> dict:
    """Batch-1 decode: median gap between token arrivals (the streamer sees each token as it reaches
    the host) and time to the first token."""
    from transformers.generation.streamers import BaseStreamer

    class Clock(BaseStreamer):
        def __init__(self) -> None:
            self.times: list[float] = []

        def put(self, value) -> None:  # first call: the prompt; then one per new token
            self.times.append(time.perf_counter())

        def end(self) -> None:
            pass

    def one(ids: list[int], tokens: int) -> tuple[float, list[float]]:
        x = torch.tensor([ids], device=device)
        clock = Clock()
        sync(device)
        t0 = time.perf_counter()
        hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=tokens, min_new_tokens=tokens,
                    do_sample=False, pad_token_id=0, streamer=clock)
        arrivals = clock.times[1:]
        return arrivals[0] - t0, [b - a for a, b in zip(arrivals, arrivals[1:])]

    one(prompts[0][:16], 4)  # warm up
    ttfts, gaps = [], []
    for ids in prompts:
        ttft, g = one(ids, n)
        ttfts.append(ttft)
        gaps += g
    return _latency(ttfts, gaps)


def generate_static(hf, reqs: list[dict], batch_size: int, device: str) -> dict:
    """The W2 subset in static batches, in order, padded on the left to the batch's longest prompt
    and run to its longest output."""
    useful = generated = 0
    sync(device)
    t0 = time.perf_counter()
    for i in range(0, len(reqs), batch_size):
        batch = reqs[i:i + batch_size]
        width, n = max(len(r["prompt_ids"]) for r in batch), max(r["output_len"] for r in batch)
        x = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros_like(x)
        for row, r in enumerate(batch):
            x[row, width - len(r["prompt_ids"]):] = torch.tensor(r["prompt_ids"])
            mask[row, width - len(r["prompt_ids"]):] = 1
        hf.generate(x.to(device), attention_mask=mask.to(device), max_new_tokens=n, min_new_tokens=n,
                    do_sample=False, pad_token_id=0)
        useful += sum(r["output_len"] for r in batch)
        generated += len(batch) * n
    sync(device)
    duration = time.perf_counter() - t0
    prompt = sum(len(r["prompt_ids"]) for r in reqs)
    return {"requests": len(reqs), "batch_size": batch_size, "duration_s": duration,
            "output_tokens": useful, "generated_tokens": generated, "output_tok_s": useful / duration,
            "total_tok_s": (useful + prompt) / duration}


def _cb_config(device: str, reqs: list[tuple[list[int], int]]):
    """Defaults on the GPU (cache sized from free memory); on the CPU a cache just big enough (the
    memory-based sizing allocates for many seconds there)."""
    if device.startswith("cuda"):
        return None
    from transformers import ContinuousBatchingConfig

    blocks = sum((len(ids) + n) // CPU_BLOCK_TOKENS + 2 for ids, n in reqs) + 8
    return ContinuousBatchingConfig(num_blocks=blocks, max_batch_tokens=CPU_MAX_BATCH_TOKENS)


def _cb_run(hf, reqs: list[tuple[list[int], int]], device: str, one_at_a_time: bool) -> tuple[float, list, str]:
    """-> (seconds from the first request added to the last result, GenerationOutputs, attention impl)."""
    from transformers import GenerationConfig

    try:
        from transformers.generation.continuous_batching.utils import WorkloadHints
        hints = WorkloadHints(max_prompt_length=max(len(ids) for ids, _ in reqs),
                              max_generated_length=max(n for _, n in reqs), num_requests=len(reqs))
    except ImportError:  # transformers without workload hints
        hints = None
    gen = GenerationConfig(do_sample=False, max_new_tokens=max(n for _, n in reqs), eos_token_id=-1, pad_token_id=0)
    kw = {"workload_hints": hints} if hints is not None else {}
    outputs = []
    with hf.continuous_batching_context_manager(generation_config=gen, continuous_batching_config=_cb_config(
            device, reqs), **kw) as manager:
        attn = hf.config._attn_implementation
        t0 = time.perf_counter()
        batches = [[r] for r in reqs] if one_at_a_time else [reqs]
        for batch in batches:
            ids = {manager.add_request(p, max_new_tokens=n, record_timestamps=True, eos_token_id=-1) for p, n in batch}
            while ids:
                out = manager.get_result(timeout=600)
                if out is None:
                    raise RuntimeError(f"continuous batching: no result within 600 s ({len(ids)} outstanding)")
                if out.is_finished() and out.request_id in ids:
                    if out.error is not None:
                        raise RuntimeError(f"continuous batching request failed: {out.error}")
                    ids.discard(out.request_id)
                    outputs.append(out)
        duration = time.perf_counter() - t0
    return duration, outputs, attn


def cb_w1(hf, prompts: list[list[int]], n: int, device: str) -> dict:
    _, outs, attn = _cb_run(hf, [(p, n) for p in prompts], device, one_at_a_time=True)
    ttfts = [o.timestamps[0] - o.created_time for o in outs]
    gaps = [b - a for o in outs for a, b in zip(o.timestamps, o.timestamps[1:])]
    return {**_latency(ttfts, gaps), "attn_implementation": attn}


def cb_offline(hf, reqs: list[dict], device: str) -> dict:
    duration, outs, attn = _cb_run(hf, [(r["prompt_ids"], r["output_len"]) for r in reqs], device, one_at_a_time=False)
    out_tokens = sum(len(o.generated_tokens) for o in outs)
    prompt = sum(len(r["prompt_ids"]) for r in reqs)
    return {"requests": len(reqs), "duration_s": duration, "output_tokens": out_tokens,
            "requested_tokens": sum(r["output_len"] for r in reqs), "output_tok_s": out_tokens / duration,
            "total_tok_s": (out_tokens + prompt) / duration, "attn_implementation": attn}


def timed_phase(res: dict, name: str, fn) -> None:
    """Run one baseline; its result (with its wall time) or its error goes under ``name``."""
    t0 = time.perf_counter()
    try:
        res[name] = fn()
    except Exception as e:  # recorded in the output, never hidden: the suite prints it in the table
        res[name] = {"error": f"{e!r}"[:500], "traceback": traceback.format_exc()[-2000:]}
    res[name]["wall_s"] = time.perf_counter() - t0
    print(f"hf {name}: {res[name]['wall_s']:.1f} s", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--requests", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch-size", type=int, default=32, help="static batch size of generate on the W2 subset")
    ap.add_argument("--engines", default="generate,cb", help="generate and/or cb (continuous batching)")
    args = ap.parse_args()
    import transformers

    spec = json.loads(args.requests.read_text())
    w1, w2 = spec["w1"], spec["w2"]
    engines = set(args.engines.split(","))
    t0 = time.perf_counter()
    hf = load(args.model, args.device)
    res: dict = {"device": args.device, "transformers": transformers.__version__, "load_s": time.perf_counter() - t0,
                 "w2_subset_requests": len(w2), "w1_runs": len(w1["prompts"])}
    with torch.inference_mode():
        if "generate" in engines:
            timed_phase(res, "generate_w1", lambda: generate_w1(hf, w1["prompts"], w1["output_len"], args.device))
            if w2:
                timed_phase(res, "generate_w2", lambda: generate_static(hf, w2, args.batch_size, args.device))
    if "cb" in engines:  # the manager runs its own thread (and inference mode)
        timed_phase(res, "cb_w1", lambda: cb_w1(hf, w1["prompts"], w1["output_len"], args.device))
        if w2:
            timed_phase(res, "cb_w2", lambda: cb_offline(hf, w2, args.device))
    args.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
