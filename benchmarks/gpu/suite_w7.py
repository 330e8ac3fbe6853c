"""W7 (priority scheduling) of the GPU suite: background batch traffic at ``w7_load`` × capacity
(priority 0, long outputs) for ``w7_duration`` seconds with interactive requests at ``w7_rate`` req/s
(priority ``W7_PRIORITY``) alongside, on a server with ``--enable-priority-scheduling`` and on one
without. The interactive users are ``banyan bench --priority`` in a process of their own.

Reports the issue's three numbers: interactive TTFT p99, its ITL p99 over the idle one (the same
requests alone), total output throughput with priority scheduling over without.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time

from banyan.bench import datasets
from banyan.bench.backends import GrpcBackend
from banyan.bench.datasets import BenchRequest
from banyan.bench.runner import run as bench_run
from benchmarks.gpu.suite_workloads import Recording, Sizes, brief, get_load, serve_run

SEED_W7_CALIB, SEED_W7_IDLE, SEED_W7_BG, SEED_W7_INT = range(110, 114)
W7_PRIORITY = 10  # the interactive requests' priority (the background's is 0)


def w7_background(s: Sizes, vocab: int, num: int, seed: int = SEED_W7_BG) -> list[BenchRequest]:
    return [dataclasses.replace(r, priority=0) for r in
            datasets.random_requests(num, (s.w7_bg_input,) * 2, (s.w7_bg_output,) * 2, vocab, seed)]


def w7_capacity(target: str, s: Sizes, vocab: int) -> dict:
    """Background-shaped requests all at once: the request rate the server sustains for that shape."""
    summary, _ = serve_run(target, w7_background(s, vocab, s.w7_calib_num, SEED_W7_CALIB))
    return {"capacity_req_s": summary["request_throughput"], "output_tok_s": summary["output_throughput"],
            "completed": summary["completed"], "failed": summary["failed"]}


def w7_client(target: str, s: Sizes, vocab: int, num: int, seed: int) -> tuple[subprocess.Popen, str]:
    """The interactive users: ``banyan bench`` in a process of its own (their latencies are not
    those of a client loop busy streaming ~10k background tokens a second): ``num`` random requests of
    w7_int_input / w7_int_output tokens, priority ``W7_PRIORITY``, at ``w7_rate`` → (process, its JSON)."""
    fd, out = tempfile.mkstemp(prefix="w7_interactive_", suffix=".json")
    os.close(fd)
    cmd = [sys.executable, "-m", "banyan", "bench", "--target", target, "--dataset", "random",
           "--num-prompts", str(num), "--input-len", f"{s.w7_int_input}:{s.w7_int_input}",
           "--output-len", f"{s.w7_int_output}:{s.w7_int_output}", "--vocab-size", str(vocab), "--seed", str(seed),
           "--request-rate", str(s.w7_rate), "--priority", str(W7_PRIORITY), "--no-progress", "--save-token-times",
           "--out", out]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL), out


def w7_client_result(client: tuple[subprocess.Popen, str]) -> dict:
    p, out = client
    try:
        if p.wait() not in (0, 1):  # (1: some requests failed — counted in the summary)
            raise RuntimeError(f"the W7 interactive client exited with {p.returncode}")
        with open(out) as f:
            return json.load(f)
    finally:
        for path in (out, os.path.splitext(out)[0] + ".png"):
            if os.path.exists(path):
                os.unlink(path)


def w7_idle(target: str, s: Sizes, vocab: int) -> dict:
    """Interactive requests alone at their rate: their TTFT and ITL with nothing else running."""
    summary = w7_client_result(w7_client(target, s, vocab, s.w7_idle_num, SEED_W7_IDLE))
    return {k: summary[k] for k in ("completed", "failed", "ttft_ms", "itl_ms", "output_throughput")}


def w7_mixed(target: str, s: Sizes, vocab: int, capacity_req_s: float) -> dict:
    """Background at w7_load x capacity and interactive at w7_rate, both Poisson, for w7_duration
    seconds of arrivals; measured until every request finished."""
    bg = w7_background(s, vocab, max(1, round(s.w7_load * capacity_req_s * s.w7_duration)))

    async def go() -> tuple[dict, float]:
        backend = GrpcBackend(target, s.w7_connections, s.w7_bg_stream_interval)
        try:
            t0 = time.perf_counter()
            return await bench_run(Recording(backend), bg, s.w7_load * capacity_req_s, 0, progress=False,
                                   seed=1), t0
        finally:
            await backend.close()

    before = get_load(target)
    fg = w7_client(target, s, vocab, max(1, round(s.w7_rate * s.w7_duration)), SEED_W7_INT)
    bg_sum, t0 = asyncio.run(go())
    fg_sum = w7_client_result(fg)
    wall = time.perf_counter() - t0
    after = get_load(target)
    tokens = bg_sum["total_output_tokens"] + fg_sum["total_output_tokens"]
    return {"background": brief(bg_sum), "interactive": brief(fg_sum), "wall_s": wall, "output_tok_s": tokens / wall,
            "output_tokens": tokens, "preemptions": after.preemptions - before.preemptions,
            "retractions": after.retractions - before.retractions,
            # each interactive request's token arrivals, Unix s: their gaps against the step trace (itl_trace)
            "interactive_token_epochs": fg_sum.get("token_epochs", [])}


def w7(start, s: Sizes, vocab: int) -> dict:
    """Capacity, the interactive requests alone, and the mixed traffic on a server with priority
    scheduling; the same mixed traffic on one without. ``start(name, *flags)`` starts a warmed-up
    server (a ``tests.support.Server``)."""
    on = start("w7_priority", "--enable-priority-scheduling", *s.w7_priority_flags)
    try:
        capacity = w7_capacity(on.target, s, vocab)
        print(f"[suite] W7 capacity {capacity['capacity_req_s']:.2f} req/s", flush=True)
        idle = w7_idle(on.target, s, vocab)
        _say("idle", idle)
        urgent = _urgent_steps(on)
        res_on = w7_mixed(on.target, s, vocab, capacity["capacity_req_s"])
        res_on["urgent_steps"] = _urgent_steps(on) - urgent
        _say("priority on", res_on["interactive"], res_on["output_tok_s"])
    finally:
        on.stop()
    off = start("w7_plain")
    try:
        res_off = w7_mixed(off.target, s, vocab, capacity["capacity_req_s"])
    finally:
        off.stop()
    return w7_summary(capacity, idle, res_on, res_off)


def _urgent_steps(server) -> float:
    """The scheduler's count of urgent steps (priority scheduling) so far."""
    for line in server.metrics("scheduler").splitlines():
        if line.startswith("banyan:priority_urgent_steps_total "):
            return float(line.split()[-1])
    return 0.0


def _say(what: str, x: dict, tok_s: float | None = None) -> None:
    """A W7 run's interactive latencies as soon as they are known (the log keeps them if a time
    limit cuts the workload short)."""
    t, i = x["ttft_ms"], x["itl_ms"]
    print(f"[suite] W7 {what}: interactive TTFT p50/p99 {t['p50']:.1f}/{t['p99']:.1f} ms, ITL p50/p99 "
          f"{i['p50']:.1f}/{i['p99']:.1f} ms" + (f", output {tok_s:,.0f} tok/s" if tok_s else ""), flush=True)


def w7_summary(capacity: dict, idle: dict, on: dict, off: dict) -> dict:
    """The issue's three numbers: interactive TTFT p99, its ITL p99 over the idle one, total output
    throughput with priority scheduling over without."""
    itl_idle = idle["itl_ms"]["p99"]
    return {"capacity": capacity, "idle": idle, "priority_on": on, "priority_off": off,
            "interactive_ttft_p99_ms": on["interactive"]["ttft_ms"]["p99"],
            "interactive_ttft_p99_ms_priority_off": off["interactive"]["ttft_ms"]["p99"],
            "itl_p99_vs_idle": on["interactive"]["itl_ms"]["p99"] / itl_idle if itl_idle else None,
            "throughput_vs_priority_off": on["output_tok_s"] / off["output_tok_s"] if off["output_tok_s"] else None}
