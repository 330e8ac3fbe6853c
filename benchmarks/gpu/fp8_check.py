"""FP8 KV cache and FP8 weights on the H200, in one call (≤ 5 min): kernels, capacity, accuracy, speed.

    source .gpucache/env.sh && python3 -m benchmarks.gpu.fp8_check --model /tmp/llama8b --out $OUT/fp8_check.json
    python3 -m benchmarks.gpu.fp8_check --cpu-smoke --out /tmp/fp8_smoke.json   # the same sections on a tiny model, CPU

Builds the Llama-3.1-8B-shaped model first if it is missing (benchmarks/gpu/make_model.py, ~40 s).
Sections, each on its own (a failure prints its error and the rest still runs):
 1. kernels: which FP8 kernels the worker uses (Triton checked against PyTorch on the device)
 2. attention: one layer of paged decode at batch 64 x 1k, bf16 vs FP8 KV, tensor-core vs CUDA-core
    decode (µs, which FP8 variant is faster), FP8 vs bf16 output error; the shared-prefix (cascade)
    path over an FP8 pool against the torch reference, per-layer and per-head scales
 3. gemm: torch._scaled_mm (row-wise scales, with and without the per-token activation quantization)
    vs the bf16 GEMM at M = 1, 8, 64, 256 on the 8B shapes (µs per call, in CUDA graphs, weights
    cycled through copies larger than L2)
 4. runners (the worker's ModelRunner, CUDA graphs to batch 8): bf16 / FP8 KV / FP8 weights / FP8 weights
    with FP8 embeddings and lm_head (--fp8-vocab), each at
    --mem-fraction-static 0.85: KV pool tokens (ratio), weight bytes (ratio), batch-1 decode graph
    replay (W1-like), and logits of 8 x (128 + 128 prompt tokens, 16 teacher-forced decode steps;
    the second chunk and the decodes read the pool) → top-1 agreement with bf16 on positions where
    bf16's top-2 margin ≥ 0.1, relative error; the same steps without graphs (graphs vs eager);
    FP8 weights also with an FP8 lm_head (what if)
 5. checkpoint: an FP8 checkpoint of the model (HF fp8 layout, per-channel scales) written, loaded
    through the worker and served (its logits against the online-quantized run's)
Prints a table last; writes everything as JSON to --out.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.driver import Driver  # noqa: E402
from benchmarks.gpu.fp8_table import table  # noqa: E402
from services.worker.quant import fp8 as fp8_mod  # noqa: E402
from services.worker.quant.fp8 import FP8, fp8_linear, quantize_rows  # noqa: E402
from services.worker.runner import ModelRunner  # noqa: E402
from shared.config import WorkerConfig  # noqa: E402

R: dict = {}  # the results (JSON)
SHAPES_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
             "lm_head": (128256, 4096)}
SMOKE_MODEL = dict(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=2, head_dim=32,
                   vocab_size=1024, num_hidden_layers=2, max_position_embeddings=4096)


def section(name: str, fn, *args) -> None:
    t0 = time.perf_counter()
    print(f"== {name}", flush=True)
    try:
        R[name] = fn(*args)
    except Exception as e:  # one failure must not lose the rest
        traceback.print_exc()
        R[name] = {"error": f"{type(e).__name__}: {e}"[:500]}
    R.setdefault("seconds", {})[name] = round(time.perf_counter() - t0, 1)
    print(json.dumps(R[name], default=str)[:1500], flush=True)


def cuda_us(fn, reps: int = 50) -> float:
    """Median µs of ``fn`` on the device (CUDA events), after a warm-up."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


# --- 1, 2: kernels and attention --------------------------------------------------------------------


def kernels(device: torch.device) -> dict:
    from services.worker.quant import enable_cuda_kernels

    return enable_cuda_kernels(device) if device.type == "cuda" else {"skipped": "needs CUDA"}


def attention(device: torch.device) -> dict:
    from services.worker.attention.base import AttentionBatch
    from services.worker.attention.flashinfer_backend import FlashInferAttention
    from services.worker.attention.torch_backend import TorchAttention
    from services.worker.kv_pool import KVPool
    from services.worker.quant.kv import KVScales
    from tests.cascade_cases import GROUPED, build

    if device.type != "cuda":
        return {"skipped": "needs CUDA + FlashInfer"}
    hq, hkv, d, bs, ctx = 32, 8, 128, 64, 1024
    g = torch.Generator(device="cpu").manual_seed(0)
    slots = (torch.randperm(bs * ctx, generator=g) + 1).view(bs, ctx).int()
    table = torch.cat([slots, torch.zeros(1, ctx, dtype=torch.int32)]).to(device)
    prefix = [ctx - 1] * bs
    batch = AttentionBatch(req_to_token=table, rows=torch.arange(bs, device=device),
                           prefix_lens=torch.tensor(prefix, device=device), extend_lens=torch.ones(bs, device=device,
                           dtype=torch.int64), out_slots=table[:bs, ctx - 1].long(),
                           positions=torch.full((bs,), ctx - 1, device=device), prefix_lens_cpu=prefix,
                           extend_lens_cpu=[1] * bs)
    q = torch.randn(bs, hq, d, generator=g).bfloat16().to(device)
    k, v = (torch.randn(bs, hkv, d, generator=g).bfloat16().to(device) for _ in range(2))
    kv_vals = [torch.randn(bs * ctx + 1, hkv, d, generator=g).bfloat16().to(device) for _ in range(2)]
    out, outs = {}, {}
    for kv_name, kv_dtype in (("bf16", None), ("fp8", FP8)):
        pool = KVPool(1, bs * ctx + 1, hkv, d, torch.bfloat16, device, kv_dtype=kv_dtype)
        pool.store(0, torch.arange(bs * ctx + 1, device=device), *kv_vals)
        for variant, tc in (("tensor_cores", True), ("cuda_cores", False)):
            try:
                attn = FlashInferAttention(pool, hq, decode_tensor_cores=tc)
                attn.prepare(batch)
                outs[(kv_name, variant)] = attn.forward(q, k, v, 0).float()
                out[f"decode_64x1k_{kv_name}_{variant}_us"] = cuda_us(lambda a=attn: a.forward(q, k, v, 0))
            except Exception as e:
                out[f"decode_64x1k_{kv_name}_{variant}_us"] = f"failed: {e!r}"[:300]
    fp8_times = {v: out.get(f"decode_64x1k_fp8_{v}_us") for v in ("tensor_cores", "cuda_cores")}
    fp8_times = {k: t for k, t in fp8_times.items() if isinstance(t, float)}
    out["fp8_faster_decode"] = min(fp8_times, key=fp8_times.get) if fp8_times else None
    ref = outs.get(("bf16", "tensor_cores"))
    for key, o in outs.items():
        if ref is not None and key[0] == "fp8":
            out[f"fp8_vs_bf16_rel_err_{key[1]}"] = ((o - ref).norm() / ref.norm()).item()
    for name in GROUPED:  # the shared-prefix path over an FP8 pool vs the torch reference reading the same pool
        for scales in ("layer", "head"):
            plain_pool, plain, grouped, (qc, kc, vc) = build(name, 32, 8, 128, torch.bfloat16, "cuda")
            ks = torch.linspace(0.5, 2.0, 8) if scales == "head" else torch.full((8,), 1.5)
            pool = KVPool(1, plain_pool.num_slots, 8, 128, torch.bfloat16, device, kv_dtype=FP8,
                          scales=KVScales([ks], [ks.flip(0)], "check"))
            pool.store(0, torch.arange(plain_pool.num_slots, device=device), plain_pool.k[0], plain_pool.v[0])
            ref_attn = TorchAttention(pool)
            ref_attn.prepare(plain)
            want = ref_attn.forward(qc, kc, vc, 0).float()
            fi = FlashInferAttention(pool, 32)
            fi.prepare(grouped)
            got = fi.forward(qc, kc, vc, 0).float()
            out[f"cascade_fp8_{scales}_{name}_rel_err"] = ((got - want).norm() / want.norm()).item()
    return out


# --- 3: GEMMs ------------------------------------------------------------------------------------------


def gemm(device: torch.device, shapes: dict) -> dict:
    if device.type != "cuda":
        return {"skipped": "needs CUDA (torch._scaled_mm)"}
    out = {}
    for name, (n, k) in shapes.items():
        copies = max(2, math.ceil(256e6 / (n * k)))  # fp8 copies beyond the 50 MB L2 (bf16: twice that)
        w16 = [torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02 for _ in range(min(copies, 8))]
        w8 = [quantize_rows(w) for w in w16]
        for m in (1, 8, 64, 256):
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            xq, xs = fp8_mod._act_quant(x)  # (the kernel the worker uses: Triton once checked)
            ones = torch.ones((), device=device)
            variants = {
                "bf16": lambda i: torch.nn.functional.linear(x, w16[i % len(w16)]),
                "fp8_rowwise": lambda i: torch._scaled_mm(xq, w8[i % len(w8)][0].t(), scale_a=xs,
                                                          scale_b=w8[i % len(w8)][1].view(1, n), out_dtype=x.dtype),
                "fp8_rowwise_with_act_quant": lambda i: fp8_linear(x, w8[i % len(w8)][0], w8[i % len(w8)][1], None),
                "fp8_tensorwise": lambda i: torch._scaled_mm(xq, w8[i % len(w8)][0].t(), scale_a=ones, scale_b=ones,
                                                             out_dtype=x.dtype),
            }
            for v, fn in variants.items():
                try:
                    out[f"{name}_m{m}_{v}_us"] = graph_us(fn, 2 * len(w8))
                except Exception as e:
                    out[f"{name}_m{m}_{v}_us"] = f"failed: {e!r}"[:200]
            b, f = out.get(f"{name}_m{m}_bf16_us"), out.get(f"{name}_m{m}_fp8_rowwise_with_act_quant_us")
            if isinstance(b, float) and isinstance(f, float):
                out[f"{name}_m{m}_speedup"] = b / f
        del w16, w8
        torch.cuda.empty_cache()
    return out


def graph_us(fn, calls: int) -> float:
    """µs per call of ``fn(i)`` for i in range(calls), captured in one CUDA graph (no launch gaps)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(calls):
            fn(i)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    return cuda_us(graph.replay, reps=20) / calls


# --- 4, 5: runners ---------------------------------------------------------------------------------------


def make_runner(model: str, device: str, **cfg) -> ModelRunner:
    cfg = {"device": device, "cuda_graph_max_bs": 8, "context_length": 32768, "mem_fraction_static": 0.85, **cfg}
    if device == "cpu":
        cfg.update(dtype="bfloat16", cuda_graph_max_bs=1)
    return ModelRunner(WorkerConfig(model=model, **cfg), model)


def workload(runner: ModelRunner, vocab: int) -> torch.Tensor:
    """Logits (CPU, float32) of the positions that read the pool: 8 prompts of 128 + 128 tokens
    (the second chunk a paged prefill over the first), then 16 teacher-forced decode steps."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, vocab, (8, 128 + 128 + 16), generator=g).tolist()
    driver, rids, parts = Driver(runner, max_rows=16), [f"s{i}" for i in range(8)], []
    runner.forward(driver.batch([(r, ids[i][:128], False) for i, r in enumerate(rids)]))
    parts.append(runner.forward(driver.batch([(r, ids[i][128:256], False) for i, r in enumerate(rids)]),
                                all_logits=True).view(8, 128, -1))
    for t in range(256, 272):
        parts.append(runner.forward(driver.batch([(r, [ids[i][t]], True) for i, r in enumerate(rids)]))[:, None])
    for r in rids:
        driver.release(r)
    return torch.cat(parts, 1).reshape(-1, parts[0].shape[-1]).float().cpu()


def agreement(ours: torch.Tensor, ref: torch.Tensor, margin: float = 0.1) -> dict:
    top2 = ref.topk(2, -1).values
    sure = (top2[:, 0] - top2[:, 1]) >= margin
    return {"top1_agreement": (ours.argmax(-1) == ref.argmax(-1))[sure].float().mean().item(),
            "positions": int(sure.sum()), "of": ref.shape[0], "rel_err": ((ours - ref).norm() / ref.norm()).item()}


def w1(runner: ModelRunner, vocab: int) -> dict:
    """Batch-1 decode: graph replay (device time) and the whole step through ``execute`` (median ms)."""
    driver = Driver(runner, max_rows=4)
    nxt = int(driver.run([("w1", torch.randint(0, vocab, (128,)).tolist(), True)])[0])
    steps = []
    for _ in range(24):
        t = time.perf_counter()
        nxt = int(driver.run([("w1", [nxt], True)])[0])
        steps.append(time.perf_counter() - t)
    out = {"step_ms": statistics.median(steps[4:]) * 1e3}
    if runner.graphs is not None:
        with torch.inference_mode():
            out["replay_ms"] = cuda_us(runner.graphs._graphs[1].replay, reps=30) / 1e3
    driver.release("w1")
    return out


def runners(model: str, device: str) -> dict:
    out, logits = {}, {}
    for name, cfg in (("bf16", {}), ("fp8_kv", {"kv_cache_dtype": "fp8_e4m3"}), ("fp8_weights", {"quantization": "fp8"}),
                      ("fp8_weights_vocab", {"quantization": "fp8", "fp8_vocab": True})):
        try:
            t0 = time.perf_counter()
            r = make_runner(model, device, **cfg)
            res = {"startup_s": time.perf_counter() - t0, "pool_tokens": r.pool_size, "weight_bytes": r.weight_bytes,
                   "kv_cache_dtype": r.kv_cache_dtype, "quantization": r.quantization}
            vocab = r.spec.vocab_size
            logits[name] = workload(r, vocab)
            if name != "bf16" and "bf16" in logits:
                res["vs_bf16"] = agreement(logits[name], logits["bf16"])
            res["w1"] = w1(r, vocab)
            if r.graphs is not None:  # the decode steps replayed graphs: the same steps eagerly
                graphs, r.graphs = r.graphs, None
                res["graphs_vs_eager_rel_err"] = agreement(logits[name], workload(r, vocab))["rel_err"]
                r.graphs = graphs
                del graphs  # (a local left holding the graphs kept the whole runner's memory: 2026-12-02)
            if name == "fp8_weights" and "bf16" in logits:  # what if lm_head were FP8 too (eager: graphs have it)
                r.graphs, head = None, r.model.lm_head
                q, s = quantize_rows(head.weight.data)
                def fp8_head(h, out=None, q=q, s=s, head=head):
                    logits = head.tp.all_gather(fp8_linear(h, q, s, None))[:, : head.vocab_size]
                    return logits.float() if out is None else out.copy_(logits)

                head.forward = fp8_head
                res["fp8_lm_head_too_vs_bf16"] = agreement(workload(r, vocab), logits["bf16"])
                res["lm_head_bytes"] = head.weight.numel() * head.weight.element_size()
                del head, fp8_head
            out[name] = res
            del r
        except Exception as e:
            traceback.print_exc()
            out[name] = {"error": f"{type(e).__name__}: {e}"[:500]}
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
        print(name, json.dumps(out[name], default=str)[:800], flush=True)
    b, k, w = out.get("bf16", {}), out.get("fp8_kv", {}), out.get("fp8_weights", {})
    if "pool_tokens" in b and "pool_tokens" in k:
        out["pool_ratio_fp8_kv"] = k["pool_tokens"] / b["pool_tokens"]
    if "weight_bytes" in b and "weight_bytes" in out.get("fp8_weights_vocab", {}):
        out["weight_ratio_fp8_vocab"] = out["fp8_weights_vocab"]["weight_bytes"] / b["weight_bytes"]
    if "weight_bytes" in b and "weight_bytes" in w:
        out["weight_ratio_fp8"] = w["weight_bytes"] / b["weight_bytes"]
        if "lm_head_bytes" in w:  # embeddings and lm_head in FP8 too (what if): each at half its bf16 bytes
            out["weight_ratio_fp8_with_head_and_embed"] = (w["weight_bytes"] - w["lm_head_bytes"]) / b["weight_bytes"]
    R["_logits_fp8_weights"] = logits.get("fp8_weights")
    return out


def checkpoint(model: str, device: str, out_dir: Path) -> dict:
    """Write the model as an HF fp8 checkpoint (per-channel scales), load it through the worker, serve."""
    from safetensors.torch import save_file

    from services.worker.quant.checkpoint import LINEAR, Checkpoint

    t0 = time.perf_counter()
    src, tensors = Checkpoint(model), {}
    dev = device if device == "cuda" else "cpu"
    for name in src.names():
        t = src.get(name)
        if LINEAR.search(name):
            q, s = quantize_rows(t.to(dev))
            tensors[name], tensors[name.removesuffix("weight") + "weight_scale"] = q.cpu(), s[:, None].cpu()
        else:
            tensors[name] = t
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
    del tensors
    cfg = json.loads((Path(model) / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3"}
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=1))
    for f in Path(model).iterdir():
        if f.name.startswith("tokenizer") or f.name in ("special_tokens_map.json", "generation_config.json"):
            (out_dir / f.name).write_bytes(f.read_bytes())
    res = {"write_s": time.perf_counter() - t0, "bytes": (out_dir / "model.safetensors").stat().st_size}
    t0 = time.perf_counter()
    r = make_runner(str(out_dir), device)
    res.update(load_s=time.perf_counter() - t0, quantization=r.quantization, weight_bytes=r.weight_bytes)
    logits = workload(r, r.spec.vocab_size)
    if R.get("_logits_fp8_weights") is not None:  # the same per-channel quantization as --quantization fp8
        res["vs_online_fp8"] = agreement(logits, R["_logits_fp8_weights"])
    res["w1"] = w1(r, r.spec.vocab_size)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="/tmp/llama8b")
    ap.add_argument("--tokenizer", default=".assets/llama3")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp")) / "fp8_check.json")
    ap.add_argument("--checkpoint-dir", type=Path, default=Path("/tmp/llama8b-fp8"))
    ap.add_argument("--budget-s", type=float, default=250, help="skip the checkpoint section past this many seconds")
    ap.add_argument("--cpu-smoke", action="store_true", help="a tiny model on the CPU: the script's logic, no speed")
    ap.add_argument("--init", choices=("hf", "conditioned"), default="hf",
                    help="how a missing --model is drawn (make_model.py: conditioned = errors that do not grow "
                         "layer by layer, for the accuracy figures)")
    args = ap.parse_args()
    t0 = time.perf_counter()
    from benchmarks.gpu.make_model import build

    device = "cpu" if args.cpu_smoke else "cuda"
    if args.cpu_smoke:
        import services.worker.runner as runner_mod

        runner_mod.CPU_KV_BYTES = 64 << 20  # a budget the pools fill (bf16 vs FP8: the ratio shows)
        args.model = str(build(Path("/tmp/fp8_smoke_model"), None, device="cpu", **SMOKE_MODEL))
        args.checkpoint_dir = Path("/tmp/fp8_smoke_model-fp8")
    elif not (Path(args.model) / "config.json").exists():
        build(Path(args.model), Path(args.tokenizer), init=args.init)
    R.update(date=time.strftime("%Y-%m-%d %H:%M"), torch=torch.__version__, model=args.model, init=args.init,
             device=device,
             gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    section("kernels", kernels, dev)
    section("attention", attention, dev)
    section("gemm", gemm, dev, SHAPES_8B if device == "cuda" else {})
    section("runners", runners, args.model, device)
    if time.perf_counter() - t0 < args.budget_s:
        section("checkpoint", checkpoint, args.model, device, args.checkpoint_dir)
    else:
        R["checkpoint"] = {"skipped": f"past the {args.budget_s:.0f} s budget"}
    R.pop("_logits_fp8_weights", None)
    R["total_s"] = round(time.perf_counter() - t0, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(R, indent=1, default=str))
    print(f"\nJSON: {args.out}  ({R['total_s']} s)\n" + table(R, SHAPES_8B), flush=True)


if __name__ == "__main__":
    main()
