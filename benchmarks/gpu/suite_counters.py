"""The worker's, scheduler's and tokenizers' counters around one workload of the GPU suite (their
Prometheus text, before and after it): steps by kind, GPU busy/idle, shared-prefix steps, grammar
bitmask time, full-GC pauses."""

from __future__ import annotations


def worker_counters(server) -> dict | None:
    """The worker's GPU busy/idle second counters (None when its metrics have no idle counter)."""
    from prometheus_client.parser import text_string_to_metric_families

    if not server.worker_metrics_port:
        return None
    sums = {"idle": 0.0, "busy": 0.0}
    found = False
    for fam in text_string_to_metric_families(server.metrics("worker")):
        for kind in sums:
            if f"gpu_{kind}" in fam.name:
                found |= kind == "idle"
                sums[kind] += sum(s.value for s in fam.samples if not s.name.endswith("_created"))
        if fam.name == "banyan:cascade_steps":  # steps run with shared-prefix attention groups (not the
            sums["cascade_steps"] = sum(x.value for x in fam.samples if x.name.endswith("_total"))  # _created family)
        if fam.name in ("banyan:step_device_seconds", "banyan:step_idle_seconds", "banyan:step_tokens",
                        "banyan:step_host_seconds", "banyan:step_turnaround_seconds"):
            what = fam.name.split("_", 1)[1].split("_")[0]  # device / idle / tokens, by the step's kind
            for smp in fam.samples:
                kind = smp.labels.get("kind")
                if kind and not smp.name.endswith("_created") and not smp.name.endswith("_bucket"):
                    part = "count" if smp.name.endswith("_count") else "total"
                    sums[f"step|{kind}|{what}_{part}"] = smp.value
        if "grammar_mask_" in fam.name:  # histograms: seconds and count of the steps with a bitmask
            kind = "fill" if "fill" in fam.name else "wait"
            for smp in fam.samples:
                if smp.name.endswith("_sum") or smp.name.endswith("_count"):
                    sums[f"mask_{kind}{smp.name[smp.name.rindex('_'):]}"] = smp.value
    # full collections (generation 2): the whole process stops
    for service in ("worker", "scheduler", *(("tokenizer",) if server.http_port > 0 else ())):
        for fam in text_string_to_metric_families(server.metrics(service)):
            for smp in fam.samples if fam.name == "banyan:gc_pause_seconds" else ():
                part = smp.name.rsplit("_", 1)[1]
                if smp.labels.get("generation") == "2" and part in ("sum", "count"):
                    sums[f"gc2|{service}|{part}"] = smp.value
    return sums if found else None


def tier_counters(server) -> dict | None:
    """The scheduler's tier counters: bytes moved by direction, tokens demoted (None: no metrics)."""
    from prometheus_client.parser import text_string_to_metric_families

    if not server.scheduler_metrics_port:
        return None
    out = {}
    try:
        text = server.metrics("scheduler")
    except OSError:
        return None
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            if smp.name == "banyan:hicache_moved_bytes_total":
                out[f"moved_bytes|{smp.labels.get('direction')}"] = smp.value
            elif smp.name == "banyan:hicache_demoted_tokens_total":
                out["demoted_tokens"] = smp.value
    return out


def worker_delta(res, workload: str, before: dict, after: dict) -> float | None:
    """What the worker's counters say of one workload (``worker_counters`` before and after it),
    added to its results ``res``: steps by kind, W3's shared-prefix steps, the grammar bitmask's
    fill and wait per constrained step, full GC pauses of worker, scheduler and tokenizers. → the GPU's
    idle share."""
    idle, busy = after["idle"] - before["idle"], after["busy"] - before["busy"]
    if isinstance(res, dict):
        res["steps_by_kind"] = steps_by_kind(before, after)
        res["gc_full"] = {svc: {"count": int(after[f"gc2|{svc}|count"] - before.get(f"gc2|{svc}|count", 0)),
                                "ms": 1e3 * (after[f"gc2|{svc}|sum"] - before.get(f"gc2|{svc}|sum", 0))}
                          for svc in ("worker", "scheduler", "tokenizer") if f"gc2|{svc}|count" in after}
        if workload == "W3" and "cascade_steps" in after:
            res["cascade_steps"] = after["cascade_steps"] - before.get("cascade_steps", 0)
        for kind in ("fill", "wait"):  # grammar bitmask time per constrained step
            n = after.get(f"mask_{kind}_count", 0) - before.get(f"mask_{kind}_count", 0)
            if n:
                res[f"mask_{kind}_ms_per_step"] = (after[f"mask_{kind}_sum"] - before.get(f"mask_{kind}_sum", 0)) / n * 1e3
                res[f"mask_{kind}_steps"] = n
    return idle / (idle + busy) if idle + busy > 0 else None


def steps_by_kind(before: dict, after: dict) -> dict:
    """The worker's steps during one workload, by kind (``worker_counters`` before and after it):
    {kind: steps, device ms per step, idle ms before them in all, tokens}."""
    out = {}
    for key in after:
        if key.startswith("step|") and key.endswith("|device_count"):
            kind = key.split("|")[1]
            d = {k: after.get(f"step|{kind}|{k}", 0.0) - before.get(f"step|{kind}|{k}", 0.0)
                 for k in ("device_count", "device_total", "idle_total", "tokens_total", "host_count", "host_total",
                           "turnaround_count", "turnaround_total")}
            if d["device_count"] > 0:
                out[kind] = {"steps": int(d["device_count"]), "device_ms_mean": d["device_total"] / d["device_count"] * 1e3,
                             "idle_ms": d["idle_total"] * 1e3, "tokens": int(d["tokens_total"])}
                for part in ("host", "turnaround"):  # the worker's launch; the scheduler's turnaround
                    if d[f"{part}_count"] > 0:
                        out[kind][f"{part}_ms_mean"] = d[f"{part}_total"] / d[f"{part}_count"] * 1e3
    return out
