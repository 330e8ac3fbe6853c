"""CPU benchmark of the scheduler's host work per JSON-constrained decode step (no worker, no GPU).

With overlap scheduling the worker samples step N+1 only once the scheduler has processed step N's
output (accepted its tokens into the grammar matchers, jump-forward, stop checks, TokenOut
messages) and sent N+1's deferred bitmask (``StepMask``). That path is the worker's wait. This runs
the REAL ``Scheduler.loop`` (batcher, KV bookkeeping, grammar backend, step_io, message encoding)
with the sockets replaced by an instantaneous fake worker: for every constrained row it samples a
uniformly random token the row's bitmask allows (seeded), so the matchers walk through real JSON,
and a fake tokenizer replica that keeps ``--running`` requests in flight (a finished request is
replaced by a new one, as a closed-loop client does). Sections are timed exclusively by wrapping
the scheduler's own methods; the fake worker's time is left out.

    python -m benchmarks.bench_grammar_step [--running 64 128 256] [--steps 200] [--label before]
        [--append] [--out benchmarks/results/grammar_step_cpu_<date>.json] [--busy 1] [--gc-freeze]
    python -m cProfile -s tottime -m benchmarks.bench_grammar_step --running 256   # where time goes

``--busy N`` keeps N other processes spinning (a server's worker, tokenizer and clients share the
host): thread pools that wait for every thread (torch's intra-op pool, xgrammar's per-call fill
pool) then wait for descheduled threads.

Columns (ms per step): see ``COLUMNS``. Results go to the JSON under ``runs[label]``: each repeat
(one process) and their median; ``--append`` adds a repeat, so two variants can be run in turn.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import multiprocessing
import os
import platform
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from shared.config import SchedulerConfig  # noqa: E402
from shared.logging import setup_logging  # noqa: E402
from shared.messages.common import Constraint, SamplingParams  # noqa: E402
from shared.messages.to_scheduler import GenerateReq, WorkerReady  # noqa: E402
import services.scheduler.outputs as outputs_mod  # noqa: E402
import services.scheduler.scheduler as sched_mod  # noqa: E402
from banyan.bench.datasets import JSON_SCHEMA  # noqa: E402
from benchmarks.grammar_step_fakes import FakePoller, FakeReplica, FakeWorker, Sections  # noqa: E402

TOKENIZERS = ROOT.parent / "shared" / "assets" / "tokenizers"
# name → (vocab size of the model, its stop ids)
MODELS = {"llama3": (128_256, [128001, 128008, 128009]), "qwen3": (151_936, [151643, 151645])}
PROMPT_LEN, MAX_NEW = 256, 128  # as W4
# Six fields: strings (bounded by patterns, as the serving benchmark's schema), integers, an enum
# and an optional array of strings.
_P = JSON_SCHEMA["properties"]  # the serving benchmark's schema, two fields more (same field order as before)
SCHEMA = {**JSON_SCHEMA, "properties": {
    "name": _P["name"], "age": _P["age"], "city": _P["city"], "role": {"enum": ["admin", "user", "guest", "owner"]},
    "score": {"type": "integer", "minimum": 0, "maximum": 100000}, "tags": _P["tags"]},
    "required": [*JSON_SCHEMA["required"], "role", "score"]}
COLUMNS = {
    "fill": "xgrammar bitmask fill of the deferred StepMask",
    "accept_jf": "matcher accept, stop checks, jump-forward (in output processing)",
    "process": "the rest of output processing (bookkeeping, TokenOut messages, stage logs)",
    "mask": "the rest of making and encoding the StepMask",
    "critical": "output processing started -> StepMask encoded and sent (measured: the worker waits)",
    "build": "next batch build + extras + encode",
    "other": "flush, metrics, polling, the loop itself",
    "total": "one loop iteration (the fake worker's time left out)",
    "gc": "cyclic GC pauses (already inside the columns above)",
}


def tokenizer_dir(name: str) -> tuple[str, Path]:
    base = Path(os.environ.get("BANYAN_TOKENIZERS", TOKENIZERS))  # (a copy where the team folder is absent)
    for n in (name, "qwen3"):
        if (base / n / "tokenizer.json").exists():
            return n, base / n
    raise SystemExit(f"no tokenizer under {base}")


def model_dir(tdir: Path, tmp: str) -> str:
    """A model directory with the tokenizer (what the scheduler reads of a model)."""
    d = Path(tmp) / "model"
    d.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (d / name).write_bytes((tdir / name).read_bytes())
    (d / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return str(d)


def config_overrides(pairs: list[str]) -> dict:
    """``--set name=value`` → SchedulerConfig keyword arguments, typed like the field's default."""
    defaults = {f.name: f.default for f in dataclasses.fields(SchedulerConfig)}
    out = {}
    for pair in pairs:
        k, v = pair.split("=", 1)
        kind = type(defaults[k])
        out[k] = v.lower() in ("1", "true", "yes") if kind is bool else kind(v)
    return out


def make_scheduler(running: int, args, tmp: str):
    """A real Scheduler whose worker became ready (``_attach``: KV, batcher, grammar backend as in
    serving), with a fake worker, tokenizer replica and poller."""
    name, tdir = tokenizer_dir(args.tokenizer)
    vocab, stops = MODELS[name]
    seed = args.seed
    cfg = SchedulerConfig(model=model_dir(tdir, tmp), tokenizer_endpoint=f"ipc://{tmp}/tok",
                          worker_endpoint=f"ipc://{tmp}/wrk", max_running_requests=running,
                          **config_overrides(args.set))
    s = sched_mod.Scheduler(cfg)
    sec = Sections()
    s.worker = FakeWorker(s, sec, vocab, seed)
    pool = running * (PROMPT_LEN + MAX_NEW) * 2
    s._attach(WorkerReady(model="bench", architecture="LlamaForCausalLM", vocab_size=vocab, context_length=8192,
                          pool_size=pool, eos_token_ids=stops, device="cpu", dtype="bfloat16",
                          cuda_graph_max_bs=args.graph_bs))
    s.tok = replica = FakeReplica(sec)
    s.table._send = replica.send
    rng = np.random.default_rng(seed + 1)
    params = SamplingParams(max_new_tokens=MAX_NEW, stop_token_ids=stops, ignore_eos=args.plain)
    constraint = None if args.plain else Constraint(kind="json_schema", value=json.dumps(SCHEMA))
    systems = [rng.integers(1000, vocab - 1000, PROMPT_LEN - 32).tolist() for _ in range(args.groups)]
    counter = iter(range(1 << 30))

    def arrive() -> None:
        for _ in range(replica.refill):
            ids = rng.integers(1000, vocab - 1000, PROMPT_LEN).tolist()
            if systems:  # (a shared system prompt: one of --groups)
                ids = systems[int(rng.integers(len(systems)))] + ids[:32]
            s._on_tokenizer(b"bench", GenerateReq(rid=f"r{next(counter)}", input_ids=ids, params=params,
                                                 constraint=constraint))
        replica.refill = 0

    replica.refill = running
    arrive()
    for p in s.grammar.pending:  # compile the schema before timing anything
        p.future.result()
    s.poller = FakePoller(arrive)
    _instrument(s, sec)
    return s, sec, name


def _instrument(s, sec: Sections) -> None:
    """Time the scheduler's own methods by wrapping them on the instance, and module functions
    through the names the calling module sees (``outputs``, ``scheduler``)."""
    for attr, name in (("_update_metrics", "metrics"), ("_poll", "poll"), ("_poll_grammars", "grammar_poll")):
        setattr(s, attr, sec.wrap(name, getattr(s, attr)))
    s.table.flush = sec.wrap("flush", s.table.flush)
    a = s.applier
    a.apply, a._accept, a._grammar_done = (sec.wrap("process", a.apply), sec.wrap("accept", a._accept),
                                           sec.wrap("accept", a._grammar_done))
    g = s.engine.grammar
    g.jump_forward = sec.wrap("jump_forward", g.jump_forward)
    g.only_stop_left = sec.wrap("accept", g.only_stop_left)
    g.bitmask = sec.wrap(lambda parent: "fill" if parent in ("mask", "extras") else "accept", g.bitmask)
    outputs_mod.deferred_mask = sec.wrap("mask", _orig["deferred_mask"])
    sched_mod.with_extras = sec.wrap("extras", _orig["with_extras"])
    build = s.engine.batcher.build
    iters: list[dict] = []
    last = 0.0

    def build_marked(*a, **kw):
        """Each loop iteration builds once: close the last iteration's record here."""
        nonlocal last
        now = time.perf_counter()
        if last:
            iters.append({**sec.cur, "wall": now - last})
        sec.cur, last = defaultdict(float), now
        with sec("build"):
            return build(*a, **kw)

    s.engine.batcher.build = build_marked
    s.iterations = iters


_orig = {"with_extras": sched_mod.with_extras, "deferred_mask": outputs_mod.deferred_mask}


def _restore() -> None:
    sched_mod.with_extras, outputs_mod.deferred_mask = _orig["with_extras"], _orig["deferred_mask"]


def summarize(recs: list[dict]) -> dict:
    rows = []
    for r in recs:
        g = lambda k: r.get(k, 0.0) * 1e3  # noqa: E731
        row = {"fill": g("fill"), "accept_jf": g("accept") + g("jump_forward"), "process": g("process"),
               "mask": g("mask") + g("send_mask"), "build": g("build") + g("extras") + g("send_batch")}
        row["critical"] = g("critical")
        row["total"] = g("wall") - g("fake")
        row["other"] = row["total"] - sum(row[k] for k in ("fill", "accept_jf", "process", "mask", "build"))
        row["gc"] = g("gc")
        rows.append(row)
    return {k: {"mean": statistics.fmean(x[k] for x in rows), "p50": statistics.median(x[k] for x in rows),
                "p90": float(np.percentile([x[k] for x in rows], 90))} for k in COLUMNS}


def run_one(running: int, args) -> dict:
    steps, warmup = args.steps, args.warmup
    with tempfile.TemporaryDirectory() as tmp:
        s, sec, name = make_scheduler(running, args, tmp)
        if args.gc_freeze:  # (what a scheduler that froze its start-up heap would see)
            gc.collect()
            gc.freeze()
        s.worker.stop_after = warmup + steps + 1
        t0 = time.perf_counter()
        try:
            s.loop()
        finally:
            sec.close()
            gc.unfreeze()
            _restore()
        wall = time.perf_counter() - t0
    recs = s.iterations[warmup:warmup + steps]
    finished = [(ids, f) for ids, f in s.tok.done if f != "abort"]
    res = {"running": running, "tokenizer": name, "steps": len(recs), "warmup_steps": warmup,
           "requests_finished": len(finished), "valid_json": valid_json(s.grammar.tokenizer, finished),
           "output_tokens": s.tok.tokens, "jump_forward_tokens": s.counters.jump_forward_tokens,
           "loop_wall_s": round(wall, 2),
           "stream_digest": s.tok.digest.hexdigest()[:16], "ms_per_step": summarize(recs)}
    return res


def valid_json(tokenizer, finished: list[tuple[list[int], str]]) -> float:
    """Fraction of the requests that finished with "stop" whose text parses as a JSON object with
    the required fields (the matchers really walked the schema)."""
    stopped = [ids for ids, f in finished if f == "stop"]
    ok = 0
    for ids in stopped:
        try:
            obj = json.loads(tokenizer.decode(ids, skip_special_tokens=True))
            ok += set(SCHEMA["required"]) <= set(obj)
        except ValueError:
            pass
    return round(ok / len(stopped), 4) if stopped else 0.0


def _spin() -> None:
    while True:
        pass


def print_table(title: str, rows: list[dict], stat: str) -> None:
    print(f"\n[{title}] ms per step ({stat})")
    print(f"{'running':>8}" + "".join(f"{c:>10}" for c in COLUMNS))
    for r in rows:
        m = r["ms_per_step"]
        print(f"{r['running']:>8}" + "".join(f"{m[c][stat]:>10.2f}" for c in COLUMNS))


def combine(repeats: list[list[dict]]) -> list[dict]:
    """Per size: the median over repeats of each column's mean and p50 (repeats run in separate
    processes, alternating with the other variant, so that drifting machine load hits both)."""
    out = []
    for runs in zip(*repeats):
        ms = {c: {stat: statistics.median(r["ms_per_step"][c][stat] for r in runs) for stat in ("mean", "p50")}
              for c in COLUMNS}
        out.append({"running": runs[0]["running"], "repeats": len(runs), "ms_per_step": ms,
                    "stream_digests": sorted({r["stream_digest"] for r in runs})})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--running", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--tokenizer", default="llama3")
    ap.add_argument("--plain", action="store_true", help="unconstrained requests (EOS ignored): the host path "
                    "of a plain decode step")
    ap.add_argument("--groups", type=int, default=0, help="prompts share one of this many system prompts "
                    "(shared-prefix groups, as W3)")
    ap.add_argument("--graph-bs", type=int, default=0, help="the fake worker's largest CUDA graph (cascade rule)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--label", default="run", help="key of this run in the JSON (e.g. before / after)")
    ap.add_argument("--append", action="store_true", help="add a repeat to the label's runs (else replace them)")
    ap.add_argument("--note", default="", help="what this variant is (kept in the JSON)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results"
                    / f"grammar_step_cpu_{datetime.date.today().isoformat()}.json")
    ap.add_argument("--busy", type=int, default=0,
                    help="processes spinning on the CPUs meanwhile (the worker, tokenizers, clients of a server)")
    ap.add_argument("--fill-threads", type=int, default=0, help="override grammar.fill_threads() (0: keep)")
    ap.add_argument("--gc-freeze", action="store_true", help="gc.freeze() the heap once the scheduler is ready")
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                    help="a SchedulerConfig field (e.g. disable_jump_forward=true)")
    args = ap.parse_args()
    log_file = open(os.devnull, "w")
    stderr, sys.stderr = sys.stderr, log_file  # the scheduler's JSON log lines go nowhere (but are made)
    setup_logging("scheduler")
    sys.stderr = stderr
    if args.fill_threads:
        import services.scheduler.grammar as grammar_mod

        assert hasattr(grammar_mod, "fill_threads"), "this grammar.py picks no fill thread count"
        grammar_mod.fill_threads = lambda: args.fill_threads
    busy = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(args.busy)]
    for p in busy:
        p.start()
    try:
        results = [run_one(n, args) for n in args.running]
    finally:
        for p in busy:
            p.terminate()
    print_table(args.label, results, "p50")
    print_table(args.label, results, "mean")
    print("digests", [r["stream_digest"] for r in results], "valid JSON", [r["valid_json"] for r in results])
    doc = json.loads(args.out.read_text()) if args.out.exists() else {"benchmark": "grammar_step_cpu", "runs": {}}
    doc["columns"] = COLUMNS
    old = doc["runs"].get(args.label) if args.append else None
    repeats = (old["repeats"] if old else []) + [results]
    doc["runs"][args.label] = {"note": args.note or (old or {}).get("note", ""),
                               "date": datetime.datetime.now().isoformat(timespec="seconds"),
                               "host": {"cpus": os.cpu_count(), "machine": platform.machine(),
                                        "python": platform.python_version()},
                               "schema": SCHEMA, "prompt_len": PROMPT_LEN, "max_new_tokens": MAX_NEW,
                               "steps": args.steps, "seed": args.seed, "busy_processes": args.busy,
                               "fill_threads": args.fill_threads or "default", "gc_freeze": args.gc_freeze,
                               "config": config_overrides(args.set), "summary": combine(repeats),
                               "repeats": repeats}
    if len(repeats) > 1:
        print_table(f"{args.label}: median of {len(repeats)} repeats", doc["runs"][args.label]["summary"], "p50")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
