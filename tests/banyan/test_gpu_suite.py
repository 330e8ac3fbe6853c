"""The GPU benchmark suite (benchmarks/gpu/suite.py) end to end on the CPU in tiny mode: a 2-layer
model with the Llama 3 vocabulary, HF baselines in their own process, two ``banyan serve``
instances (radix cache on, then off), every workload at a few requests; then the JSON's fields
and the merge of two invocations' JSONs. Values are checked for sanity, never for speed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tests.support import make_tiny_model

from benchmarks.gpu import stage_trace, step_trace
from benchmarks.gpu import suite_report as report
from benchmarks.gpu.make_model import LLAMA_8B
from benchmarks.gpu.suite import TOKENIZERS
from benchmarks.gpu.suite_workloads import Sizes

ROOT = Path(__file__).resolve().parents[2]
LLAMA3 = next((t for t in TOKENIZERS if (t / "tokenizer.json").exists()), None)  # .assets/ or the team folder
SMALL = ["--length-scale", "0.05", "--w4-output", "24", "--w1-runs", "2", "--w2-num", "8", "--w3-groups", "2",
         "--w3-per-group", "3", "--w4-num", "4", "--w4-b1-num", "2", "--w5-num", "3", "--w5-rates", "50,x0.5", "--hf-subset", "4",
         "--hf-batch", "2", "--hf-w1-runs", "1", "--w3-extra", "2x3x64"]


def test_sizes_and_limits_of_the_8b_shape(tmp_path) -> None:
    s = Sizes()
    assert s.w3_optimum_hit_rate == pytest.approx((32 * 32 - 32) * 2048 / (1024 * (2048 + 128)))
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_8B))
    m = report.model_facts(str(tmp_path), 2)
    assert m["params"] == pytest.approx(8.03e9, rel=2e-3) and m["kv_bytes_per_token"] == 128 * 1024
    lim = report.limits(m, s, 256, {"W2", "W3"})
    assert 3.6 < lim["w1_floor_ms_per_token"] < 3.8  # 16.1 GB / 4.3 TB/s
    assert lim["w2"]["decode_batch"] == 256 and lim["w2"]["bytes_per_step_gb"] > m["weights_bytes"] / 1e9
    w2 = lim["w2"]  # the kernels in sequence: each decode step's GEMMs, then its KV reads — never faster
    gemm_ms = max(m["weights_bytes"] / 4.3e12, 2 * (m["params"] - m["embedding_params"]) * 256 / 790e12) * 1e3
    assert w2["sequential_step_floor_ms"] == pytest.approx(gemm_ms + w2["kv_bytes_per_step_gb"] / 4.3e12 * 1e12)
    assert w2["output_tok_s_sequential_ceiling"] < w2["output_tok_s_ceiling"]
    on, off = lim["w3_cache_on"], lim["w3_cache_off"]
    assert on["prefill_tokens"] == 32 * 2048 + 1024 * 128 and off["prefill_tokens"] == 1024 * (2048 + 128)
    assert on["output_tok_s_ceiling"] > off["output_tok_s_ceiling"]
    assert lim["w3_cache_on_shared_attention"]["output_tok_s_ceiling"] > on["output_tok_s_ceiling"]
    with pytest.raises(ValueError):
        Sizes(w2_num=0)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, demo_dir) -> tuple[Path, dict, str]:
    tmp = tmp_path_factory.mktemp("suite")
    if LLAMA3 is not None:  # the suite builds its tiny model with the real 128k vocabulary
        model = ["--model", str(tmp / "model"), "--tokenizer", str(LLAMA3)]
    else:  # (CI: no team assets) a tiny model on the demo tokenizer, built here
        model = ["--model", str(make_tiny_model("llama", tmp / "model", demo_dir, seed=3))]
    r = subprocess.run([sys.executable, "-m", "benchmarks.gpu.suite", "--tiny", *model,
                        "--out", str(tmp / "out"), "--tag", "t", "--step-trace", *SMALL],
                       cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    return tmp / "out", json.loads((tmp / "out" / "suite_t.json").read_text()), r.stdout


def test_tiny_suite_json_has_every_workload(tiny_run) -> None:
    out, doc, stdout = tiny_run
    res = doc["results"]
    assert set(res) == {"W1", "W2", "W3", "W4", "W5", "HF"} and not any("error" in v for v in res.values())
    assert doc["meta"]["tiny"] and doc["meta"]["versions"]["torch"] and "git_commit" in doc["meta"]
    assert res["W1"]["runs"] == 2 and res["W1"]["ms_per_token"] > 0 and res["W1"]["ttft_ms"] > 0
    w2 = res["W2"]
    assert w2["completed"] == 8 and w2["failed"] == 0 and w2["output_throughput"] > 0
    assert w2["total_tok_s"] > w2["output_throughput"] and w2["duration_s"] > 0 and w2["subset"]["output_tok_s"] > 0
    w3 = res["W3"]
    for k in ("cache_on", "cache_off", "cascade_off"):
        assert w3[k]["completed"] == 6 and w3[k]["failed"] == 0 and w3[k]["output_throughput"] > 0
        assert 0.0 <= w3[k]["cache_hit_rate"] <= 1.0
    assert w3["cache_off"]["cache_hit_rate"] == 0.0 and w3["cache_on"]["cache_hit_rate"] > 0
    assert 0 < w3["optimum_hit_rate"] < 1 and w3["hit_vs_optimum"] > 0 and w3["speedup"] > 0
    assert w3["cascade_speedup"] > 0 and w3["cascade_steps"] >= 0 and w3["cache_on"]["first_output_s"] > 0
    (x,) = w3["extra"].values()  # the extra shape (its system prompt scaled like the others): on and off
    assert x["cascade_on"]["completed"] == x["cascade_off"]["completed"] == 6 and x["cascade_speedup"] > 0
    w4 = res["W4"]
    assert w4["constrained"]["failed"] == 0 and w4["unconstrained"]["failed"] == 0 and w4["same_lengths"]
    assert w4["unconstrained"]["total_output_tokens"] == w4["constrained"]["total_output_tokens"]
    assert w4["ratio"] > 0 and w4["jump_forward_tokens"] >= 0
    b1 = w4["batch1"]  # the first two requests one at a time, constrained and their twins
    assert b1["requests"] == 2 and b1["constrained"]["completed"] == b1["unconstrained"]["completed"] == 2
    assert b1["overhead"] == pytest.approx(
        b1["unconstrained"]["output_throughput"] / b1["constrained"]["output_throughput"] - 1)
    rates = res["W5"]["rates"]
    assert [r["spec"] for r in rates] == ["50", "x0.5"] and rates[1]["rate"] == pytest.approx(
        0.5 * w2["request_throughput"])
    assert all(r["completed"] == 3 and r["ttft_ms"]["p99"] >= r["ttft_ms"]["p50"] > 0 for r in rates)
    hf = res["HF"]
    for k in ("generate_w1", "cb_w1"):
        assert hf[k]["ms_per_token"] > 0 and hf[k]["ttft_ms"] > 0
    for k in ("generate_w2", "cb_w2"):
        assert hf[k]["requests"] == 4 and hf[k]["output_tok_s"] > 0
    assert hf["cb_w2"]["output_tokens"] == hf["generate_w2"]["output_tokens"] == sum(
        json.loads((out / "hf_requests.json").read_text())["w2"][i]["output_len"] for i in range(4))
    assert doc["limits"]["w1_floor_ms_per_token"] > 0 and doc["limits"]["w2"]["output_tok_s_ceiling"] > 0
    assert all(v is None or 0 <= v <= 1 for v in doc["gpu_idle"].values())
    kinds = w2["steps_by_kind"]  # the worker's steps during W2, by kind: its prompts and its decodes
    assert kinds["prefill"]["steps"] > 0 and kinds["decode_eager"]["steps"] > 0 and "decode_graph" not in kinds
    assert all(v["device_ms_mean"] > 0 and v["tokens"] >= v["steps"] for v in kinds.values())
    assert all(v["host_ms_mean"] > 0 for v in kinds.values()) and kinds["decode_eager"]["turnaround_ms_mean"] > 0
    trace = step_trace.load(out / "steps_main.jsonl")  # --step-trace: the main server's worker, a line a step
    assert len(trace) >= sum(v["steps"] for v in kinds.values()) and {"prefill", "decode_eager"} <= {
        t["kind"] for t in trace}
    reqs = stage_trace.load_stages(out / "server_main.log")  # the stage lines of every request, joined by id
    done = [r for r in reqs.values() if {"received", "queued", "scheduled", "first_token", "first_out"} <= set(r)]
    assert len(done) >= 8 and all(r["received"] <= r["queued"] <= r["scheduled"] <= r["first_token"] <= r["first_out"]
                                  for r in done)
    assert all(r.get("step") in {t["step"] for t in trace} for r in done)  # (worker_admitted: a traced step)
    assert "| priority < 1 | " in stage_trace.segments(reqs, 1) and "event loop" in stage_trace.loop_lag(
        out / "server_main.log")
    assert "← its step" in stage_trace.slowest(reqs, stage_trace.load_steps(out / "steps_main.jsonl"), 0, 1)
    table = (out / "suite_t.md").read_text()
    assert stdout.rstrip().endswith(table.rstrip()) and table.count("\n| W") >= 10 and "TINY" in table


def test_merge_of_two_invocations_builds_one_table(tiny_run, tmp_path) -> None:
    out, doc, _ = tiny_run
    parts = []
    for i, names in enumerate((("W1", "W2", "HF"), ("W3", "W4", "W5"))):
        part = {**doc, "results": {k: v for k, v in doc["results"].items() if k in names},
                "gpu_idle": {k: v for k, v in doc["gpu_idle"].items() if k in names}}
        parts.append(tmp_path / f"part{i}.json")
        parts[-1].write_text(json.dumps(part))
    r = subprocess.run([sys.executable, "-m", "benchmarks.gpu.suite", "--merge", *map(str, parts), "--out",
                        str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    merged = json.loads((tmp_path / "suite_merged.json").read_text())
    assert merged["results"] == doc["results"] and len(merged["invocations"]) == 2
    assert (tmp_path / "suite_merged.md").read_text().rstrip() == (out / "suite_t.md").read_text().rstrip()


W7_SMALL = ["--length-scale", "0.05", "--w7-duration", "2", "--w7-calib-num", "6", "--w7-idle-num", "3"]


def test_tiny_w7_priority_workload(tmp_path, demo_dir) -> None:
    """W7 (priority scheduling: background at 1.5x capacity + interactive requests, on a server with
    --enable-priority-scheduling and on one without) end to end in tiny mode: every request served,
    the three numbers of the issue computed, the table's rows; the interactive requests' token times
    lined up with the step trace (``itl_trace``)."""
    if LLAMA3 is not None:
        model = ["--model", str(tmp_path / "model"), "--tokenizer", str(LLAMA3)]
    else:
        model = ["--model", str(make_tiny_model("llama", tmp_path / "model", demo_dir, seed=3))]
    r = subprocess.run([sys.executable, "-m", "benchmarks.gpu.suite", "--tiny", "--workloads", "W7", *model,
                        "--out", str(tmp_path / "out"), "--tag", "w7", "--step-trace", *W7_SMALL],
                       cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    doc = json.loads((tmp_path / "out" / "suite_w7.json").read_text())
    assert set(doc["results"]) == {"W7"}
    w7 = doc["results"]["W7"]
    cap = w7["capacity"]
    assert cap["completed"] == 6 and cap["failed"] == 0 and cap["capacity_req_s"] > 0
    n_bg = max(1, round(1.5 * cap["capacity_req_s"] * 2))
    for run in ("priority_on", "priority_off"):
        x = w7[run]
        assert x["interactive"]["completed"] == 4 and x["interactive"]["failed"] == 0
        assert x["background"]["completed"] == n_bg and x["background"]["failed"] == 0
        assert x["output_tokens"] == n_bg * 51 + 4 * 3 and x["output_tok_s"] > 0
    assert w7["idle"]["completed"] == 3 and w7["interactive_ttft_p99_ms"] > 0
    assert w7["priority_on"]["urgent_steps"] >= 0 and "urgent_steps" not in w7["priority_off"]  # (scheduler metric)
    assert w7["itl_p99_vs_idle"] > 0 and w7["throughput_vs_priority_off"] > 0
    table = (tmp_path / "out" / "suite_w7.md").read_text()
    assert table.count("| W7") == 3 and "≤ 100 ms" in table
    epochs = w7["priority_on"]["interactive_token_epochs"]
    assert len(epochs) == 4 and all(len(e) == 3 and e == sorted(e) for e in epochs)
    steps = tmp_path / "out" / "steps_w7_priority.jsonl"
    last = json.loads(steps.read_text().splitlines()[-1])["t"]
    assert max(e[-1] for e in epochs) <= last + 5  # (one clock: the client's arrivals, the worker's answers)
    r = subprocess.run([sys.executable, "-m", "benchmarks.gpu.itl_trace", str(tmp_path / "out" / "suite_w7.json"),
                        str(steps), "--over", "0"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    n = int(r.stdout.split(" gaps of 4 requests")[0])  # (2 a request; fewer where a late replica merged two)
    assert 1 <= n <= 8 and "by the step that ended them" in r.stdout, r.stdout
    assert "answered" in r.stdout and " ms into the gap" in r.stdout


def test_tiny_w6_and_w2h(tmp_path, demo_dir) -> None:
    """W6 (multi-turn on a capped pool: GPU tier only, host tier, disk tier with a restart) and W2H in
    tiny mode, named explicitly (they are not in the default set)."""
    model = make_tiny_model("llama", tmp_path / "model", demo_dir, seed=3, max_positions=2048)
    r = subprocess.run([sys.executable, "-m", "benchmarks.gpu.suite", "--tiny", "--model", str(model), "--out",
                        str(tmp_path / "out"), "--tag", "w6", "--workloads", "W6,W2H", "--w2-num", "4", "--hf-subset",
                        "0", "--w2-input", "16:32", "--w2-output", "4:8", "--w6-conversations", "5", "--w6-turns", "3",
                        "--w6-system", "64", "--w6-user", "24", "--w6-output", "6", "--w6-concurrency", "2",
                        "--w6-pool", "160", "--w6-host-gib", "1", "--w6-disk-gib", "1"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    doc = json.loads((tmp_path / "out" / "suite_w6.json").read_text())
    w6 = doc["results"]["W6"]
    assert set(w6) == {"off", "host", "disk_pass1", "disk_pass2", "host_vs_off", "disk_supplied"}
    for v in ("off", "host", "disk_pass1", "disk_pass2"):
        assert w6[v]["completed"] == 15 and w6[v]["failed"] == 0 and len(w6[v]["ttft_by_turn_ms"]) == 3
        assert 0 < w6[v]["optimum_hit_rate"] < 1 and w6[v]["ttft_later_turns_ms"]["p50"] > 0
    assert w6["off"]["load"]["host_cached_tokens"] == 0 and w6["host"]["load"]["host_cached_tokens"] > 0
    assert w6["host"]["cache_hit_rate"] > w6["off"]["cache_hit_rate"]  # the pool alone loses the history
    assert w6["disk_pass1"]["load"]["disk_written_tokens"] > 0 and w6["disk_pass2"]["load"]["disk_cached_tokens"] > 0
    assert w6["disk_pass2"]["load"]["tier_failures"] == 0
    # pass 2 replays pass 1's prompts: after the restart the disk spares most of what pass 1 computed
    assert w6["disk_supplied"] > 0.5, w6["disk_supplied"]
    assert doc["results"]["W2H"]["completed"] == 4
    assert doc["results"]["W2H"]["tier"]["moved_bytes|device_to_host"] > 0  # (write-through: every prompt backed up)
    table = (tmp_path / "out" / "suite_w6.md").read_text()
    assert "W6 multi-turn 5×3" in table and "W6 disk tier" in table and "W2H" in table
