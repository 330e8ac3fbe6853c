"""The suite's physical limits (from the model's shape and the H200's bandwidth/compute) and its
markdown table (the shape of docs/perf.md), built from the JSON alone so that the results of
several invocations merge into one table."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.gpu.suite_workloads import Sizes, w2_requests, w3_requests

HBM_BYTES_S = 4.3e12  # H200 HBM3e copy bandwidth, measured (.gpucache/README.md)
BF16_FLOP_S = 790e12  # dense bf16 GEMM, measured on the same host

GOALS = {  # key -> (goal, "le" | "ge", shown as)
    "w1_ms": (4.0, "le", "≤ 4.0"),
    "w2_tok_s": (6400, "ge", "≥ 6,400"),
    "w2_vs_generate": (10, "ge", "≥ 10×"),
    "w2_vs_cb": (3, "ge", "≥ 3×"),
    "w3_hit_vs_optimum": (0.98, "ge", "≥ 98 %"),
    "w3_speedup": (3, "ge", "≥ 3×"),
    "w3_tok_s": (15000, "ge", "≥ 15,000"),
    "w4_ratio": (0.95, "ge", "≥ 95 %"),
    "w4_b1_overhead": (0.03, "le", "≤ 3 %"),
    "gpu_idle": (0.05, "lt", "< 5 %"),
    "w7_ttft_p99_ms": (100, "le", "≤ 100 ms"),
    "w7_itl_vs_idle": (2, "le", "≤ 2×"),
    "w7_throughput_vs_off": (0.95, "ge", "≥ 95 %"),
    "w6_speedup": (3, "ge", "≥ 3×"),
    "w6_ttft": (0.3, "le", "≤ 0.3×"),
    "w6_hit_vs_optimum": (0.95, "ge", "≥ 95 %"),
    "w6_disk": (0.8, "ge", "≥ 80 %"),
    "w2h_ratio": (0.98, "ge", "≥ 98 %"),
    "w2s_ratio": (0.98, "ge", "≥ 98 %"),
}


# ---------------------------------------------------------------- model shape and limits


def model_facts(model_dir: str, dtype_bytes: int) -> dict:
    """Parameter count, weight bytes and KV bytes per token of a Llama-style HF config."""
    c = json.loads((Path(model_dir) / "config.json").read_text())
    h, inter, layers, vocab = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
    heads, kv_heads = c["num_attention_heads"], c.get("num_key_value_heads", c["num_attention_heads"])
    d = c.get("head_dim") or h // heads
    per_layer = h * heads * d * 2 + h * kv_heads * d * 2 + 3 * h * inter + 2 * h  # q, o, k, v, mlp, norms
    embed = vocab * h
    params = embed + layers * per_layer + h + (0 if c.get("tie_word_embeddings") else vocab * h)
    return {"params": params, "embedding_params": embed, "dtype_bytes": dtype_bytes,
            "weights_bytes": params * dtype_bytes, "weights_read_per_step_bytes": (params - embed) * dtype_bytes,
            "kv_bytes_per_token": 2 * layers * kv_heads * d * dtype_bytes, "layers": layers, "hidden": h,
            "heads": heads, "kv_heads": kv_heads, "head_dim": d, "vocab": vocab,
            "attn_flops_per_token_pair": 4 * layers * heads * d}


def _run_floor(m: dict, reqs: list[tuple[int, int, int]], batch: int, bw: float, flops: float,
               shared: tuple[int, int] | None = None) -> dict:
    """Lower bound on a whole offline run of (prompt, cached prefix, output) requests at a decode
    batch of ``batch``: prefill at peak compute (GEMMs + causal attention of the new tokens), then
    decode steps that each read the weights once and every running request's KV once — or, with
    ``shared`` = (groups, prefix length), each group's common prefix once per step (cascade /
    shared-prefix attention) and only the rest per request."""
    gemm = 2 * (m["params"] - m["embedding_params"])
    new = sum(p - c for p, c, _ in reqs)
    attn_pairs = sum((p - c) * c + (p - c) ** 2 / 2 for p, c, _ in reqs)
    prefill_s = (gemm * new + m["attn_flops_per_token_pair"] * attn_pairs) / flops
    out = sum(o for _, _, o in reqs)
    steps = out / batch
    groups, prefix = shared or (0, 0)
    kv = m["kv_bytes_per_token"] * (sum(o * (p - prefix) + o * (o - 1) / 2 for p, _, o in reqs)
                                    + steps * min(groups, batch) * prefix)
    step_bytes = m["weights_bytes"] + kv / steps
    step_s = max(step_bytes / bw, gemm * batch / flops)
    floor_s = prefill_s + steps * step_s
    # the kernels one after another, as the device runs them (a step's GEMMs, compute-bound at large batches, do
    # not overlap its attention's KV reads; docs/perf.md 2026-12-05 twenty-first session): at any batch the run
    # pays every decode row's GEMM compute and every KV byte
    seq_step_s = max(m["weights_bytes"] / bw, gemm * batch / flops) + kv / steps / bw
    seq_s = prefill_s + steps * seq_step_s
    return {"decode_batch": batch, "kv_tokens_read_per_output_token": kv / m["kv_bytes_per_token"] / out,
            "prefill_tokens": new,
            "bytes_per_step_gb": step_bytes / 1e9, "kv_bytes_per_step_gb": kv / steps / 1e9,
            "step_floor_ms": step_s * 1e3, "decode_ceiling_tok_s": batch / step_s, "prefill_floor_s": prefill_s,
            "run_floor_s": floor_s, "output_tok_s_ceiling": out / floor_s,
            "sequential_step_floor_ms": seq_step_s * 1e3, "sequential_run_floor_s": seq_s,
            "output_tok_s_sequential_ceiling": out / seq_s}


def limits(m: dict, s: Sizes, max_running: int, workloads: set[str], bw: float = HBM_BYTES_S,
           flops: float = BF16_FLOP_S) -> dict:
    out: dict = {"hbm_bytes_s": bw, "bf16_flop_s": flops, "max_running_requests": max_running,
                 "w1_floor_ms_per_token": m["weights_bytes"] / bw * 1e3,
                 "w1_floor_note": "all weight bytes / HBM bandwidth, one decode step per token"}
    vocab = m["vocab"]
    if "W2" in workloads:
        reqs = [(r.prompt_len, 0, r.output_len) for r in w2_requests(s, vocab)]
        out["w2"] = _run_floor(m, reqs, min(max_running, len(reqs)), bw, flops)
    if "W3" in workloads:
        reqs = w3_requests(s, vocab)
        off = [(r.prompt_len, 0, r.output_len) for r in reqs]
        seen: set = set()
        on = []
        for r in reqs:  # the first of a group computes its system prompt; the others reuse it
            key = tuple(r.prompt_ids[:s.w3_system])
            on.append((r.prompt_len, s.w3_system if key in seen else 0, r.output_len))
            seen.add(key)
        out["w3_cache_on"] = _run_floor(m, on, min(max_running, len(reqs)), bw, flops)
        out["w3_cache_on_shared_attention"] = _run_floor(m, on, min(max_running, len(reqs)), bw, flops,
                                                         shared=(s.w3_groups, s.w3_system))
        out["w3_cache_off"] = _run_floor(m, off, min(max_running, len(reqs)), bw, flops)
    return out


# ---------------------------------------------------------------- table

def _n(x, digits: int = 0) -> str:
    if x is None:
        return ""
    return f"{x:,.{digits}f}"


def _pct(x) -> str:
    return "" if x is None else f"{100 * x:.1f} %"


def _status(key: str, value) -> str:
    if value is None:
        return "n/a"
    goal, how, _ = GOALS[key]
    ok = value <= goal if how == "le" else value >= goal if how == "ge" else value < goal
    return "met" if ok else "missed"


def _get(d: dict | None, *path):
    for k in path:
        if not isinstance(d, dict) or k not in d or (isinstance(d[k], dict) and "error" in d[k]):
            return None
        d = d[k]
    return d


def _ratio(a, b):
    return a / b if a is not None and b else None


def table(doc: dict) -> str:
    """The markdown table of one (or a merged) suite JSON."""
    r, lim, meta, cfg = doc["results"], doc.get("limits", {}), doc["meta"], doc["config"]
    hf = r.get("HF") or {}
    rows: list[tuple[str, ...]] = []

    def row(metric, banyan="", gen="", cb="", limit="", goal_key=None, value=None, goal_text=None):
        goal = goal_text if goal_text is not None else (GOALS[goal_key][2] if goal_key else "")
        rows.append((metric, banyan, gen, cb, limit, goal, _status(goal_key, value) if goal_key else ""))

    if "W1" in r or hf:
        w1 = r.get("W1")
        ms = _get(w1, "ms_per_token")
        row(f"W1 batch-1 decode, in {cfg['w1_input']} / out {cfg['w1_output']}: ms/token (median gap)", _n(ms, 2),
            _n(_get(hf, "generate_w1", "ms_per_token"), 1), _n(_get(hf, "cb_w1", "ms_per_token"), 1),
            _n(lim.get("w1_floor_ms_per_token"), 2) + " (weights ÷ HBM)" if lim.get("w1_floor_ms_per_token") else "",
            "w1_ms", ms)
        row("W1 time to first token, ms", _n(_get(w1, "ttft_ms"), 1), _n(_get(hf, "generate_w1", "ttft_ms"), 1),
            _n(_get(hf, "cb_w1", "ttft_ms"), 1))
    if "W2" in r or hf:
        w2 = r.get("W2")
        tok = _get(w2, "output_throughput")
        gen, cb = _get(hf, "generate_w2", "output_tok_s"), _get(hf, "cb_w2", "output_tok_s")
        sub = cfg["hf_subset"]
        row(f"W2 offline, {cfg['w2_num']:,} requests, in {cfg['w2_input'][0]}–{cfg['w2_input'][1]:,} / out "
            f"{cfg['w2_output'][0]}–{cfg['w2_output'][1]}: output tok/s (HF: first {sub} requests)", _n(tok),
            _n(gen, 1), _n(cb, 1), f"{_n(_get(lim, 'w2', 'output_tok_s_ceiling'))} (run floor) · "
            f"{_n(_get(lim, 'w2', 'output_tok_s_sequential_ceiling'))} (kernels in sequence)" if "w2" in lim else "",
            "w2_tok_s", tok)
        row("W2 total tok/s · duration s", f"{_n(_get(w2, 'total_tok_s'))} · {_n(_get(w2, 'duration_s'), 1)}",
            f"{_n(_get(hf, 'generate_w2', 'total_tok_s'))} · {_n(_get(hf, 'generate_w2', 'duration_s'), 1)}",
            f"{_n(_get(hf, 'cb_w2', 'total_tok_s'))} · {_n(_get(hf, 'cb_w2', 'duration_s'), 1)}",
            f"{_n(_get(lim, 'w2', 'bytes_per_step_gb'), 1)} GB/step → {_n(_get(lim, 'w2', 'step_floor_ms'), 2)} ms"
            if "w2" in lim else "")
        vg, vc = _ratio(tok, gen), _ratio(tok, cb)
        row("W2 banyan (all requests) ÷ HF (subset), output tok/s", "", _n(vg, 1) + "×" if vg else "",
            _n(vc, 1) + "×" if vc else "", "", goal_text=f"{GOALS['w2_vs_generate'][2]} · {GOALS['w2_vs_cb'][2]}")
        rows[-1] = rows[-1][:-1] + (f"{_status('w2_vs_generate', vg)} · {_status('w2_vs_cb', vc)}",)
        s_tok = _get(w2, "subset", "output_tok_s")
        if s_tok is not None or gen or cb:
            row(f"W2 subset (first {sub}, same lengths) on both: output tok/s · banyan ÷ HF", _n(s_tok),
                f"{_n(gen, 1)} · {_n(_ratio(s_tok, gen), 1)}×", f"{_n(cb, 1)} · {_n(_ratio(s_tok, cb), 1)}×")
    if "W3" in r:
        w3 = r["W3"]
        on, off = _get(w3, "cache_on", "output_throughput"), _get(w3, "cache_off", "output_throughput")
        speed = _ratio(on, off)
        title = (f"W3 shared prefix {cfg['w3_groups']}×{cfg['w3_per_group']}, system {cfg['w3_system']:,} + question "
                 f"{cfg['w3_question']}, out {cfg['w3_output']}")
        lims = (f"{_n(_get(lim, 'w3_cache_on', 'output_tok_s_ceiling'))} (run floor; "
                f"{_n(_get(lim, 'w3_cache_on_shared_attention', 'output_tok_s_ceiling'))} with the prefix's KV read "
                "once per group and step)" if "w3_cache_on" in lim else "")
        row(f"{title}: output tok/s, cache on", _n(on), limit=lims, goal_key="w3_tok_s", value=on)
        row("W3 output tok/s, cache off (--disable-radix-cache) · speedup", f"{_n(off)} · {_n(speed, 2)}×",
            limit=f"{_n(_get(lim, 'w3_cache_off', 'output_tok_s_ceiling'))} (run floor)" if "w3_cache_off" in lim
            else "", goal_key="w3_speedup", value=speed)
        nc = _get(w3, "cascade_off", "output_throughput")
        if nc is not None:
            row("W3 output tok/s, cache on, cascade attention off (--disable-cascade-attention) · cascade speedup · "
                "steps with groups", f"{_n(nc)} · {_n(_ratio(on, nc), 2)}× · {_n(_get(w3, 'cascade_steps'))}")
        hit, opt = _get(w3, "cache_on", "cache_hit_rate"), _get(w3, "optimum_hit_rate")
        rel = _ratio(hit, opt)
        row("W3 cache hit rate: achieved / optimum = ratio", f"{_pct(hit)} / {_pct(opt)} = {_pct(rel)}",
            goal_key="w3_hit_vs_optimum", value=rel)
        row("W3 first output (s after the run's start), cache on", _n(_get(w3, "cache_on", "first_output_s"), 2))
        for shape, x in (w3.get("extra") or {}).items():
            xon, xoff = _get(x, "cascade_on", "output_throughput"), _get(x, "cascade_off", "output_throughput")
            row(f"shared prefix {shape.replace('x', ' × ', 1).replace('x', ', system ')}: output tok/s cascade on · "
                "off · speedup", f"{_n(xon)} · {_n(xoff)} · {_n(_ratio(xon, xoff), 2)}×")
    if "W4" in r:
        w4 = r["W4"]
        c, u = _get(w4, "constrained", "output_throughput"), _get(w4, "unconstrained", "output_throughput")
        ratio = _get(w4, "ratio")
        row(f"W4 JSON schema, {cfg['w4_num']} requests: output tok/s constrained / unconstrained (same lengths) "
            f"= ratio", f"{_n(c)} / {_n(u)} = {_pct(ratio)}", goal_key="w4_ratio", value=ratio)
        row("W4 mean output tokens · jump-forward tokens", f"{_n(_get(w4, 'mean_output_tokens'), 1)} · "
            f"{_n(_get(w4, 'jump_forward_tokens'))}")
        b1 = _get(w4, "batch1")
        if b1:
            row(f"W4 batch 1 ({b1['requests']} requests one at a time): output tok/s constrained / unconstrained · "
                "JSON overhead per token", f"{_n(_get(b1, 'constrained', 'output_throughput'))} / "
                f"{_n(_get(b1, 'unconstrained', 'output_throughput'))} · {_pct(b1.get('overhead'))}",
                goal_key="w4_b1_overhead", value=b1.get("overhead"))
        if _get(w4, "constrained", "mask_fill_ms_per_step") is not None or _get(w4, "mask_fill_ms_per_step") is not None:
            src = w4 if _get(w4, "mask_fill_ms_per_step") is not None else w4["constrained"]
            row("W4 grammar bitmask per constrained step: fill (scheduler, CPU) · worker wait, ms",
                f"{_n(src.get('mask_fill_ms_per_step'), 2)} · {_n(src.get('mask_wait_ms_per_step'), 2)} "
                f"({_n(src.get('mask_fill_steps'))} steps)")
    for x in _get(r, "W5", "rates") or []:
        row(f"W5 Poisson {x['rate']:.2f} req/s ({x['completed']} requests): TTFT p50/p99 · ITL p50/p99 ms · "
            "output tok/s", f"{_n(x['ttft_ms']['p50'], 0)}/{_n(x['ttft_ms']['p99'], 0)} · "
            f"{_n(x['itl_ms']['p50'], 1)}/{_n(x['itl_ms']['p99'], 1)} · {_n(x['output_throughput'])}")
    if "W7" in r:
        w7 = r["W7"]
        title = (f"W7 priority: background at {cfg.get('w7_load')}× capacity (in {cfg.get('w7_bg_input')} / out "
                 f"{cfg.get('w7_bg_output')}, priority 0) + interactive {cfg.get('w7_rate')} req/s (in "
                 f"{cfg.get('w7_int_input')} / out {cfg.get('w7_int_output')}, priority 10), {cfg.get('w7_duration')} s")
        ttft = _get(w7, "interactive_ttft_p99_ms")
        row(f"{title}: interactive TTFT p99 ms (priority off: "
            f"{_n(_get(w7, 'interactive_ttft_p99_ms_priority_off'), 0)})", _n(ttft, 1),
            goal_key="w7_ttft_p99_ms", value=ttft)
        itl = _get(w7, "itl_p99_vs_idle")
        row("W7 interactive ITL p99 ms under load / alone = ratio",
            f"{_n(_get(w7, 'priority_on', 'interactive', 'itl_ms', 'p99'), 1)} / "
            f"{_n(_get(w7, 'idle', 'itl_ms', 'p99'), 1)} = {_n(itl, 2)}×", goal_key="w7_itl_vs_idle", value=itl)
        thr = _get(w7, "throughput_vs_priority_off")
        row("W7 total output tok/s priority on / off = ratio (preemptions)",
            f"{_n(_get(w7, 'priority_on', 'output_tok_s'))} / {_n(_get(w7, 'priority_off', 'output_tok_s'))} = "
            f"{_pct(thr)} ({_n(_get(w7, 'priority_on', 'preemptions'))})", goal_key="w7_throughput_vs_off", value=thr)
    if "W6" in r:
        _w6_rows(row, r["W6"], cfg)
    if "W2H" in r:
        on, off = _get(r, "W2H", "output_throughput"), _get(r, "W2", "output_throughput")
        row("W2H: W2 with the host KV tier on: output tok/s · ÷ W2 (tier off)",
            f"{_n(on)} · {_pct(_ratio(on, off))}", goal_key="w2h_ratio", value=_ratio(on, off))
        tier = _get(r, "W2H", "tier")
        if isinstance(tier, dict) and tier:
            row("W2H tier traffic: GB device → host · tokens demoted (copies a forward waited for)",
                f"{_n(tier.get('moved_bytes|device_to_host', 0) / 1e9, 1)} · {_n(tier.get('demoted_tokens'))}")
    if "W2S" in r:
        off, on = _get(r, "W2S", "output_throughput"), _get(r, "W2", "output_throughput")
        row("W2S: W2 with the SMG gRPC service off (--disable-smg-grpc): output tok/s · W2 (service on) ÷ off",
            f"{_n(off)} · {_pct(_ratio(on, off))}", goal_key="w2s_ratio", value=_ratio(on, off))
    for w in ("W1", "W2", "W2H", "W3", "W4", "W5"):
        kinds = _get(r, w, "steps_by_kind")
        if isinstance(kinds, dict) and kinds:
            row(f"{w} steps by kind: count × device ms (idle ms before them, in all; host ms to queue one / "
                f"scheduler turnaround ms)", " · ".join(
                f"{k} {v['steps']} × {v['device_ms_mean']:.2f} ({v['idle_ms']:.0f}; {v.get('host_ms_mean', 0):.1f} / "
                f"{v.get('turnaround_ms_mean', 0):.1f})" for k, v in sorted(kinds.items())))
    idle = doc.get("gpu_idle") or {}  # (the goal holds for every workload: the worst one is judged)
    main = max((v for w, v in idle.items() if v is not None and w in ("W1", "W2", "W3", "W4", "W5")), default=None)
    detail = ", ".join(f"{w} {_pct(v)}" for w, v in idle.items() if v is not None)
    row("GPU idle between steps (worker gpu_idle ÷ (idle + busy))", detail or "n/a", goal_key="gpu_idle", value=main)

    head = ("metric", "banyan", "HF `generate`", "HF continuous batching", "physical limit", "goal", "status")
    lines = [f"## Banyan GPU suite: {meta.get('device', '?')}, commit {(meta.get('git_commit') or '?')[:10]}"
             f"{' (dirty)' if meta.get('git_dirty') else ''}, {meta.get('date', '')}", "",
             "| " + " | ".join(head) + " |", "| --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    lines += ["| " + " | ".join(x) + " |" for x in rows]
    notes = [f"HF baselines (same model, same run, separate process; transformers {hf.get('transformers', '?')}) use "
             f"only the first {cfg['hf_subset']} W2 requests (static batches of {cfg['hf_batch']} padded left for "
             "`generate`; all at once for continuous batching) and "
             f"{cfg['hf_w1_runs']} W1 run(s); W2 ratios divide banyan's full run by HF's subset."] if hf else []
    notes.append(f"Limits: HBM {lim.get('hbm_bytes_s', HBM_BYTES_S) / 1e12:.1f} TB/s, bf16 "
                 f"{lim.get('bf16_flop_s', BF16_FLOP_S) / 1e12:.0f} TFLOP/s; run floor = prefill at peak compute + "
                 "decode steps of (weights + running KV) bytes at the max decode batch (or its GEMMs' compute, "
                 "whichever is more); kernels in sequence = the same with each decode step's GEMMs (weights or "
                 "compute) and its KV reads one after the other, as the device runs them.")
    if meta.get("tiny"):
        notes.append("TINY model on CPU: a functional check of the suite, not a performance result.")
    return "\n".join(lines + [""] + [f"- {n}" for n in notes])


def _w6_rows(row, w6: dict, cfg: dict) -> None:
    off, host = w6.get("off"), w6.get("host")
    tok = [_get(w6, v, "output_throughput") for v in ("off", "host")]
    ttft = [_get(w6, v, "ttft_later_turns_ms", "p50") for v in ("off", "host")]
    row(f"W6 multi-turn {cfg['w6_conversations']}×{cfg['w6_turns']}, system {cfg['w6_system']:,} + user "
        f"{cfg['w6_user']} / out {cfg['w6_output']} a turn, {cfg['w6_concurrency']} users, GPU pool "
        f"{cfg['w6_pool']:,} tokens: output tok/s GPU tier only · with the host tier ({cfg['w6_host_gib']} GiB) "
        "· ratio",
        f"{_n(tok[0])} · {_n(tok[1])} · {_n(_ratio(tok[1], tok[0]), 2)}×", goal_key="w6_speedup",
        value=_ratio(tok[1], tok[0]))
    row("W6 TTFT p50 of turns 2+, ms: GPU tier only · host tier · ratio",
        f"{_n(ttft[0], 1)} · {_n(ttft[1], 1)} · {_n(_ratio(ttft[1], ttft[0]), 2)}×", goal_key="w6_ttft",
        value=_ratio(ttft[1], ttft[0]))
    for name, res in (("GPU tier only", off), ("host tier", host)):
        if isinstance(res, dict) and "ttft_by_turn_ms" in res:
            row(f"W6 TTFT p50 by turn, ms ({name})", " · ".join(_n(d["p50"], 1) for d in res["ttft_by_turn_ms"]))
    hit, opt = _get(host, "cache_hit_rate"), _get(host, "optimum_hit_rate")
    row("W6 cache hit rate with the host tier (from the host): achieved / optimum = ratio",
        f"{_pct(hit)} ({_pct(_get(host, 'host_fraction'))}) / {_pct(opt)} = {_pct(_ratio(hit, opt))}",
        goal_key="w6_hit_vs_optimum", value=_ratio(hit, opt))
    p1, p2 = w6.get("disk_pass1"), w6.get("disk_pass2")
    if p1 or p2:
        row("W6 disk tier: output tok/s pass 1 · pass 2 after a restart; pass 2 prompt tokens cached (loaded "
            "from disk); share of cold pass 1's computed prompt tokens that pass 2 got from the disk",
            f"{_n(_get(p1, 'output_throughput'))} · {_n(_get(p2, 'output_throughput'))}; "
            f"{_pct(_get(p2, 'engine_hit_rate'))} ({_pct(_get(p2, 'disk_fraction'))}); "
            f"{_pct(_get(w6, 'disk_supplied'))}", goal_key="w6_disk", value=_get(w6, "disk_supplied"))


def merge(docs: list[dict]) -> dict:
    """One document from several invocations: results, limits and idle fractions united (later
    wins); each workload's sizes from the invocation that ran it; every invocation's meta kept."""
    out = {"meta": dict(docs[0]["meta"]), "config": dict(docs[0]["config"]), "results": {}, "limits": {},
           "gpu_idle": {}, "timings_s": {}, "invocations": [d["meta"] for d in docs]}
    for d in docs:
        out["results"].update(d["results"])
        prefixes = tuple({"HF": "hf_"}.get(w, w.lower() + "_") for w in d["results"])
        out["config"].update({k: v for k, v in d["config"].items() if k.startswith(prefixes)})
        out["limits"].update(d.get("limits", {}))
        out["gpu_idle"].update(d.get("gpu_idle", {}))
        out["timings_s"].update(d.get("timings_s", {}))
    commits = {d["meta"].get("git_commit") for d in docs}
    if len(commits) > 1:
        out["meta"]["git_commit"] = "+".join(sorted(c or "?" for c in commits))
    return out
