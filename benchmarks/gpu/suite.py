"""The GPU benchmark suite of the performance issue, in one go on the one-H200 host: the
random-weight Llama-3.1-8B-shaped model (Llama 3 tokenizer), HF transformers baselines in their
own process first, then ``banyan serve`` (extra flags after ``--``) for

  W1  batch-1 decode, in 128 / out 256: ms/token (median token gap), TTFT
  W2  offline: 1,024 requests, in 256–2,048 / out 64–512, all at once: output and total tok/s
  W3  shared prefix, 32 groups × 32 (2,048-token system prompt + 128 question, out 256): radix cache
      on, then a second server with --disable-radix-cache and a third with --disable-cascade-attention:
      tok/s, speedups, hit rate vs optimum, steps with shared-prefix attention
  W4  JSON schema (256 requests), then the same workload unconstrained with the same output lengths
  W5  Poisson arrivals at three rates (W2 lengths, 200 requests each): TTFT/ITL p50/p99
  HF  HF ``generate`` (static batches) and continuous batching on W1 and the first W2 requests
  W7  (--workloads W7 only) priority: background at 1.5x capacity + interactive 2 req/s, priority on vs
      off: interactive TTFT p99, ITL p99 vs alone, total tok/s (suite_w7.py)
  W6, W2H (only when named): multi-turn on a capped GPU pool, host / disk KV tiers; W2 with the host
      tier, W2S: W2 without the SMG gRPC service (suite_w6.py)

    python -m benchmarks.gpu.suite --out /tmp/banyan-gpu/suite                     # everything
    python -m benchmarks.gpu.suite --workloads W1,W2,HF --out D                    # two invocations,
    python -m benchmarks.gpu.suite --workloads W3,W4,W5 --out D                    #  then one table:
    python -m benchmarks.gpu.suite --merge D/suite_W1-W2-HF.json D/suite_W3-W4-W5.json --out D
    python -m benchmarks.gpu.suite --workloads W7 --out D                          # priority (~7 min)
    python -m benchmarks.gpu.suite --tiny --scale 0.02 --length-scale 0.1 ...      # CPU, 2 layers

Writes ``suite_<tag>.json`` (raw numbers, sizes, limits, versions, commit; rewritten after every
workload) and ``suite_<tag>.md`` under --out; the markdown table is printed last.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import signal
import subprocess
import sys
import time
import traceback
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT)]

from benchmarks.gpu import suite_counters  # noqa: E402
from benchmarks.gpu.suite_args import parser, sizes_from  # noqa: E402
from benchmarks.gpu import suite_report as report  # noqa: E402
from benchmarks.gpu import suite_w6, suite_w7  # noqa: E402
from benchmarks.gpu import suite_workloads as wl  # noqa: E402
from benchmarks.gpu.make_model import build  # noqa: E402

DEFAULT_WORKLOADS = ("W1", "W2", "W3", "W4", "W5", "HF")
WORKLOADS = (*DEFAULT_WORKLOADS, "W7", "W6", "W2H", "W2S")  # (W7, W6, W2H, W2S: only when named; own servers)
TINY_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=16384)
TOKENIZERS = (ROOT / ".assets/llama3", ROOT.parent / "shared/assets/tokenizers/llama3")
def environment(args, model: str) -> dict:
    def version(pkg: str) -> str | None:
        dist = next(iter(metadata.distributions(name=pkg)), None)
        return dist.version if dist is not None else None

    def git(*a: str) -> str:
        r = subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True)
        return r.stdout.strip() if r.returncode == 0 else ""

    device = f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    if not args.tiny:  # nvidia-smi, not torch: this process never holds GPU memory the server could use
        r = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True)
        device = r.stdout.strip().replace("\n", "; ") or "GPU (nvidia-smi failed)"
    return {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "device": device, "model": model, "tiny": args.tiny,
            # (BANYAN_GIT_COMMIT: a copy of the tree whose .git is not its own, e.g. the device machine's)
            "git_commit": os.environ.get("BANYAN_GIT_COMMIT") or git("rev-parse", "HEAD"),
            "git_dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
            "argv": sys.argv[1:], "serve_args": args.serve_args, "python": platform.python_version(),
            "versions": {p: version(p) for p in ("torch", "transformers", "flashinfer-python", "xgrammar", "grpcio",
                                                 "numpy")}}


class Suite:
    def __init__(self, args) -> None:
        self.args, self.sizes = args, sizes_from(args)
        self.workloads = [w.strip().upper() for w in args.workloads.split(",") if w.strip()]
        unknown = set(self.workloads) - set(WORKLOADS)
        if unknown:
            raise SystemExit(f"--workloads: unknown {sorted(unknown)} (choose from {', '.join(WORKLOADS)})")
        self.tokenizer = args.tokenizer or next((t for t in TOKENIZERS if (t / "tokenizer.json").exists()), None)
        self.model = args.model or ("/tmp/banyan-suite-tiny" if args.tiny else "/tmp/llama8b")
        self.device = "cpu" if args.tiny else "cuda"
        args.out.mkdir(parents=True, exist_ok=True)
        tag = args.tag or "-".join(self.workloads)
        self.json_path, self.md_path = args.out / f"suite_{tag}.json", args.out / f"suite_{tag}.md"
        self.doc: dict = {"meta": environment(args, self.model), "config": dataclasses.asdict(self.sizes),
                          "workloads": self.workloads, "results": {}, "limits": {}, "gpu_idle": {}, "timings_s": {}}
        self.t0 = time.perf_counter()
        self.failed = False
        self.facts: dict = {}

    def save(self) -> None:
        self.json_path.write_text(json.dumps(self.doc, indent=1))

    def phase(self, name: str, fn, store: str | None = None):
        """Run ``fn``, print its wall time, keep its result (under results[store]) or its error."""
        t = time.perf_counter()
        print(f"[suite] {name} ...", flush=True)
        try:
            out = fn()
        except Exception as e:  # one workload's failure is recorded and reported, the others still run
            self.failed = True
            traceback.print_exc()
            out = {"error": f"{e!r}"[:1000]}
        dt = time.perf_counter() - t
        self.doc["timings_s"][name] = dt
        if store:
            self.doc["results"][store] = out
        print(f"[suite] {name}: {dt:.1f} s (elapsed {time.perf_counter() - self.t0:.0f} s)", flush=True)
        self.save()
        return out

    # ------------------------------------------------------------------ steps

    def build_model(self) -> None:
        """The tiny model here; the 8B one on the GPU in a process of its own (whose CUDA context and
        cached 16 GB go away with it)."""
        if (Path(self.model) / "config.json").exists():
            return
        if self.tokenizer is None:
            raise SystemExit(f"no Llama 3 tokenizer (looked in {', '.join(map(str, TOKENIZERS))}); pass --tokenizer")
        if self.args.tiny:
            build(Path(self.model), self.tokenizer, device="cpu", **TINY_SHAPE)
            return
        subprocess.run([sys.executable, "-m", "benchmarks.gpu.make_model", "--out", self.model, "--tokenizer",
                        str(self.tokenizer)], cwd=ROOT, env=_env(), check=True, timeout=600)

    def hf(self) -> dict:
        s, vocab = self.sizes, self.facts["vocab"]
        reqs = {"w1": {"prompts": wl.w1_prompts(s, vocab)[:s.hf_w1_runs], "output_len": s.w1_output},
                "w2": [{"prompt_ids": r.prompt_ids, "output_len": r.output_len}
                       for r in wl.w2_requests(s, vocab)[:s.hf_subset]]}
        spec, out = self.args.out / "hf_requests.json", self.json_path.with_name(self.json_path.stem + "_hf.json")
        spec.write_text(json.dumps(reqs))
        log = self.json_path.with_name(self.json_path.stem + "_hf.log")
        cmd = [sys.executable, "-m", "benchmarks.gpu.hf_baselines", "--model", self.model, "--requests", str(spec),
               "--out", str(out), "--device", self.device, "--batch-size", str(s.hf_batch),
               "--engines", self.args.hf_engines]
        with open(log, "w") as f:
            r = subprocess.run(cmd, cwd=ROOT, env=_env(), stdout=f, stderr=subprocess.STDOUT, timeout=self.args.hf_timeout)
        if r.returncode != 0:
            raise RuntimeError(f"HF baselines exited {r.returncode}:\n{log.read_text(errors='replace')[-3000:]}")
        res = json.loads(out.read_text())
        for k in ("generate_w1", "generate_w2", "cb_w1", "cb_w2"):
            if "error" in res.get(k, {}):
                self.failed = True
                print(f"[suite] HF {k} failed: {res[k]['error']}", flush=True)
        return res

    def server(self, name: str, *flags: str):
        from tests.support import Server

        args = ["--http-port", "-1", *(["--device", "cpu"] if self.args.tiny else []), *flags, *self.args.serve_args]
        trace = {"BANYAN_STEP_TRACE": str(self.args.out / f"steps_{name}.jsonl")} if self.args.step_trace else None
        t0 = time.perf_counter()
        s = Server(self.model, self.args.out / f"server_{name}.log", *args, env=trace)
        t1 = time.perf_counter()
        try:
            wl.warm_up(s.target, self.facts["vocab"], json_too="W4" in self.workloads)
        except BaseException:
            s.stop()
            raise
        # where the start went: the worker's phases (its model_loaded line), then serving ready and the warm-up
        phases = next((r["startup_s"] for r in s.log_records() if "startup_s" in r), {})
        took = self.doc.setdefault("startup_s", {})[name] = {**phases, "ready": round(t1 - t0, 2),
                                                             "warm_up": round(time.perf_counter() - t1, 2)}
        print(f"[suite] server {name} start-up s: {took}", flush=True)
        return s

    def serve_workloads(self) -> None:
        s, vocab = self.sizes, self.facts["vocab"]
        todo = [w for w in ("W1", "W2", "W3", "W4", "W5") if w in self.workloads]
        if not todo:
            return
        server = self.phase("start server", lambda: self.server("main"))
        if isinstance(server, dict):  # the error: every server workload carries it
            self.doc["results"].update({w: server for w in todo})
            return
        try:
            fns = {"W1": lambda: wl.w1(server.target, s, vocab), "W2": lambda: wl.w2(server.target, s, vocab),
                   "W3": lambda: _w3_on(wl.w3(server.target, s, vocab), self.w3_extra(server, "cascade_on")),
                   "W4": lambda: wl.w4(server.target, s, vocab),
                   "W5": lambda: wl.w5(server.target, s, vocab, _req_s(self.doc["results"].get("W2")))}
            for w in todo:
                before = self.counters(server)
                self.phase(w, fns[w], store=w)
                after = self.counters(server)
                if before is not None and after is not None:
                    self.doc["gpu_idle"][w] = suite_counters.worker_delta(self.doc["results"].get(w), w, before, after)
        finally:
            server.stop()
        if "W3" in todo and "error" not in self.doc["results"]["W3"]:
            res = self.phase("W3 cache off", self.w3_off)
            if res is not None:  # its error
                self.doc["results"]["W3"]["cache_off"] = res
                self.save()

    def w3_extra(self, server, key: str) -> dict:
        """The extra shared-prefix shapes on ``server`` (each one's error kept, the others still run)."""
        out = {}
        for shape in self.sizes.w3_extra:
            t = time.perf_counter()
            try:
                out[shape] = wl.w3_shape(server.target, self.sizes, self.facts["vocab"], shape)
            except Exception as e:  # noqa: BLE001
                self.failed = True
                traceback.print_exc()
                out[shape] = {"error": f"{e!r}"[:1000]}
            print(f"[suite] W3 {shape} ({key}): {time.perf_counter() - t:.1f} s", flush=True)
        return out if key == "cascade_off" else {shape: {"cascade_on": res} for shape, res in out.items()}

    def counters(self, server) -> dict | None:
        try:
            return suite_counters.worker_counters(server)
        except OSError as e:  # the metrics endpoint is optional: the idle column says n/a
            print(f"[suite] worker metrics unavailable: {e!r}", flush=True)
            return None

    def w3_off(self) -> None:
        """W3 again on a server without the radix cache, then on one with the cache but without
        shared-prefix (cascade) attention (what the groups add on top of the cache)."""
        w3 = self.doc["results"]["W3"]
        wanted = {b.strip() for b in self.args.w3_baselines.split(",")}
        for key, name, flag in (("cache_off", "no_radix", "--disable-radix-cache"),
                                ("cascade_off", "no_cascade", "--disable-cascade-attention")):
            if key not in wanted:
                continue
            server = self.server(name, flag)
            try:
                w3[key] = wl.w3(server.target, self.sizes, self.facts["vocab"])
                if key == "cascade_off":
                    for shape, res in self.w3_extra(server, "cascade_off").items():
                        w3["extra"][shape]["cascade_off"] = res
                        on_x, off_x = res_tok_s(w3["extra"][shape]["cascade_on"]), res_tok_s(res)
                        w3["extra"][shape]["cascade_speedup"] = on_x / off_x if off_x else 0.0
            finally:
                server.stop()
            on, off = w3["cache_on"]["output_throughput"], w3[key]["output_throughput"]
            w3["speedup" if key == "cache_off" else "cascade_speedup"] = on / off if off else 0.0
            self.save()

    def run(self) -> int:
        if self.phase("model", self.build_model) is not None:  # its error
            return self.finish(self.doc)
        dtype_bytes = 4 if self.args.tiny or "float32" in self.args.serve_args else 2
        self.facts = self.doc["model_facts"] = report.model_facts(self.model, dtype_bytes)
        max_running = _flag(self.args.serve_args, "--max-running-requests", 256 if self.args.tiny else 1024)
        self.doc["limits"] = report.limits(self.facts, self.sizes, max_running, set(self.workloads), self.args.hbm_bw,
                                           self.args.peak_flops)
        try:
            if "HF" in self.workloads:
                self.phase("HF baselines", self.hf, store="HF")
            self.serve_workloads()
            suite_w6.run(self)
            if "W7" in self.workloads:
                self.phase("W7", lambda: suite_w7.w7(self.server, self.sizes, self.facts["vocab"]), store="W7")
        except KeyboardInterrupt:  # SIGTERM too (a timeout): the servers are stopped, report what finished
            self.failed = True
            self.doc["interrupted"] = True
            print(f"[suite] interrupted after {time.perf_counter() - self.t0:.0f} s: partial results", flush=True)
        self.doc["timings_s"]["total"] = time.perf_counter() - self.t0
        self.save()
        return self.finish(self.doc)

    def finish(self, doc: dict) -> int:
        md = report.table(doc)
        self.md_path.write_text(md + "\n")
        print(f"[suite] {self.json_path}  {self.md_path}  total {time.perf_counter() - self.t0:.0f} s", flush=True)
        print(md, flush=True)
        return 1 if self.failed else 0


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH")))))


def _w3_on(on: dict, extra: dict) -> dict:
    return {"cache_on": on, "optimum_hit_rate": on["optimum_hit_rate"], "hit_vs_optimum": on["hit_vs_optimum"],
            "extra": extra}


def res_tok_s(res: dict) -> float:
    return res.get("output_throughput", 0.0) if isinstance(res, dict) else 0.0


def _req_s(w2: dict | None) -> float | None:
    return w2.get("request_throughput") if w2 and "error" not in w2 else None


def _flag(argv: list[str], name: str, default: int) -> int:
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            return int(argv[i + 1])
        if a.startswith(name + "="):
            return int(a.split("=", 1)[1])
    return default


def main(argv: list[str] | None = None) -> int:
    args = parser(__doc__, WORKLOADS, DEFAULT_WORKLOADS).parse_args(argv)
    if args.merge:
        docs = [json.loads(p.read_text()) for p in args.merge]
        doc = report.merge(docs)
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"suite_{args.tag or 'merged'}.json"
        path.write_text(json.dumps(doc, indent=1))
        md = report.table(doc)
        path.with_suffix(".md").write_text(md + "\n")
        print(f"[suite] merged {len(docs)} into {path}", flush=True)
        print(md, flush=True)
        return 0
    signal.signal(signal.SIGTERM, _interrupt)
    return Suite(args).run()


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


if __name__ == "__main__":
    sys.exit(main())
