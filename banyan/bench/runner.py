"""Send a workload at a request rate (Poisson arrivals, or all at once) under a concurrency cap,
and summarise: throughput, TTFT, inter-token latency, time per output token, end-to-end latency."""

from __future__ import annotations

import asyncio
import random
import statistics
import time

from banyan.bench.backends import Result
from banyan.bench.datasets import BenchRequest


async def run(backend, requests: list[BenchRequest], request_rate: float, max_concurrency: int,
              ignore_eos: bool = True, temperature: float = 0.0, seed: int = 0, progress: bool = True,
              token_epochs: bool = False) -> dict:
    """``token_epochs``: the summary also lists each completed request's token arrival times as Unix
    seconds (``token_epochs``), to line them up with the server's logs and step trace."""
    rng = random.Random(seed)
    epoch = time.time() - time.perf_counter()  # (perf_counter's zero on the wall clock)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency > 0 else None
    bar = None
    if progress:  # in output tokens as they stream (a request's first ones can take a while), requests aside
        from tqdm import tqdm

        bar = tqdm(total=sum(r.output_len for r in requests), desc="output tokens", unit="tok")
        bar.set_postfix_str(f"0/{len(requests)} requests")
    done = 0

    async def one(r: BenchRequest) -> Result:
        nonlocal done
        args = (r, ignore_eos, temperature) + ((bar.update,) if bar is not None else ())
        if sem is None:
            res = await backend.send(*args)
        else:
            async with sem:
                res = await backend.send(*args)
        done += 1
        if bar is not None:  # the tokens it did not produce (EOS, failure): the bar still ends at its total
            bar.update(max(0, r.output_len - len(res.token_times)))
            bar.set_postfix_str(f"{done}/{len(requests)} requests", refresh=False)
        return res

    start = time.perf_counter()
    tasks = []
    for r in requests:
        tasks.append(asyncio.create_task(one(r)))
        if request_rate != float("inf"):
            await asyncio.sleep(rng.expovariate(request_rate))
    results = await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    if bar is not None:
        bar.close()
    summary = summarize(results, duration, start)
    if token_epochs:
        summary["token_epochs"] = [[round(epoch + t, 6) for t in r.token_times] for r in results if r.ok]
    return summary


def _pct(xs: list[float], p: float) -> float:
    if not xs:
        return 0.0
    xs = sorted(xs)
    k = min(len(xs) - 1, max(0, round(p / 100 * (len(xs) - 1))))
    return xs[k]


def _dist(xs: list[float]) -> dict:
    ms = [x * 1e3 for x in xs]
    return {"mean": statistics.fmean(ms) if ms else 0.0, "p50": _pct(ms, 50), "p90": _pct(ms, 90),
            "p99": _pct(ms, 99)}


def _throughput_over_time(results: list[Result], start: float, duration: float) -> list[float]:
    """Output tokens per second in one-second bins from the start of the run."""
    bins = [0.0] * (int(duration) + 1)
    for r in results:
        for t in r.token_times:
            bins[min(len(bins) - 1, max(0, int(t - start)))] += 1
    return bins


def summarize(results: list[Result], duration: float, start: float = 0.0) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_len for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    tpot = [(r.latency - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1]
    return {
        "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "input_throughput": in_tokens / duration,
        "output_throughput": out_tokens / duration,
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "cached_tokens": sum(r.cached_tokens for r in ok),
        "cache_hit_rate": sum(r.cached_tokens for r in ok) / in_tokens if in_tokens else 0.0,
        "ttft_ms": _dist([r.ttft for r in ok]),
        "itl_ms": _dist([x for r in ok for x in r.itl]),
        "tpot_ms": _dist(tpot),
        "e2e_ms": _dist([r.latency for r in ok]),
        "latencies_s": [r.latency for r in ok],
        "ttfts_s": [r.ttft for r in ok],
        "output_tok_s_per_second": _throughput_over_time(ok, start, duration) if start else [],
    }


def table(summary: dict) -> str:
    s = summary
    rows = [
        ("Successful requests", f"{s['completed']}"), ("Failed requests", f"{s['failed']}"),
        ("Duration (s)", f"{s['duration_s']:.2f}"),
        ("Request throughput (req/s)", f"{s['request_throughput']:.2f}"),
        ("Input throughput (tok/s)", f"{s['input_throughput']:.1f}"),
        ("Output throughput (tok/s)", f"{s['output_throughput']:.1f}"),
        ("Cache hit rate", f"{s['cache_hit_rate']:.3f}"),
    ]
    for key, name in (("ttft_ms", "TTFT"), ("itl_ms", "ITL"), ("tpot_ms", "TPOT"), ("e2e_ms", "E2E latency")):
        d = s[key]
        rows.append((f"{name} mean / p50 / p90 / p99 (ms)",
                     f"{d['mean']:.2f} / {d['p50']:.2f} / {d['p90']:.2f} / {d['p99']:.2f}"))
    if s.get("ttft_by_turn_ms"):  # (multiturn)
        rows.append(("Cache hit rate / optimum", f"{s['cache_hit_rate']:.3f} / {s['optimum_hit_rate']:.3f}"))
        for key in ("p50", "p90"):
            rows.append((f"TTFT {key} by turn (ms)", " ".join(f"{d[key]:.1f}" for d in s["ttft_by_turn_ms"])))
        rows.append(("Cache hit rate by turn", " ".join(f"{h:.2f}" for h in s["hit_rate_by_turn"])))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def plot(summary: dict, path: str) -> bool:
    """Latency CDFs (TTFT, end to end) and output throughput over time as a PNG; False when
    matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, key, title, scale, unit in ((axes[0], "ttfts_s", "Time to first token", 1e3, "ms"),
                                        (axes[1], "latencies_s", "End-to-end latency", 1.0, "s")):
        xs = sorted(x * scale for x in summary[key])
        ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))])
        ax.set(title=f"{title} (CDF)", xlabel=unit, ylabel="fraction of requests")
    series = summary.get("output_tok_s_per_second") or []
    axes[2].plot(range(len(series)), series)
    axes[2].set(title="Output throughput over time", xlabel="s since start", ylabel="tokens/s")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
