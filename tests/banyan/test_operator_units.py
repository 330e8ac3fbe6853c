"""Pieces of `banyan check-env` and `banyan top` that need no server: histogram quantiles and
deltas from Prometheus text, the ready-file layout, FlashInfer kernel detection, Banyan's kernel and tuning caches,
port checks, and `banyan --help` / `--version`."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from banyan.tools import check_env, top
from banyan.tools.promtext import Scrape, delta_buckets, parse, quantile, rate
from tests.support import ROOT

TEXT = """# HELP banyan:ttft_seconds x
# TYPE banyan:ttft_seconds histogram
banyan:ttft_seconds_bucket{le="0.1"} 10.0
banyan:ttft_seconds_bucket{le="0.2"} 30.0
banyan:ttft_seconds_bucket{le="0.4"} 40.0
banyan:ttft_seconds_bucket{le="+Inf"} 40.0
banyan:ttft_seconds_count 40.0
banyan:ttft_seconds_sum 6.0
# HELP banyan:request_success_total x
# TYPE banyan:request_success_total counter
banyan:request_success_total{finish_reason="stop"} 5.0
banyan:request_success_total{finish_reason="error"} 2.0
"""


def test_quantiles_interpolate_within_the_bucket_like_promql() -> None:
    b = Scrape("u", 0.0, parse(TEXT)).buckets("banyan:ttft_seconds")
    assert b == [(0.1, 10.0), (0.2, 30.0), (0.4, 40.0), (float("inf"), 40.0)]
    assert quantile(b, 0.25) == pytest.approx(0.1)  # rank 10: the top of the first bucket
    assert quantile(b, 0.5) == pytest.approx(0.15)  # rank 20: halfway through (0.1, 0.2]
    assert quantile(b, 0.875) == pytest.approx(0.3)  # rank 35: halfway through (0.2, 0.4]
    assert quantile([(0.1, 0.0), (float("inf"), 0.0)], 0.5) is None
    assert quantile([(0.1, 1.0), (float("inf"), 5.0)], 0.99) == 0.1  # in +Inf: the highest finite bound


def test_window_is_the_difference_of_two_scrapes_and_resets_count_from_zero() -> None:
    prev = [(0.1, 10.0), (0.2, 30.0), (float("inf"), 40.0)]
    cur = [(0.1, 10.0), (0.2, 34.0), (float("inf"), 44.0)]
    assert delta_buckets(cur, prev) == [(0.1, 0.0), (0.2, 4.0), (float("inf"), 4.0)]
    assert quantile(delta_buckets(cur, prev), 0.5) == pytest.approx(0.15)
    restarted = [(0.1, 1.0), (0.2, 1.0), (float("inf"), 1.0)]
    assert delta_buckets(restarted, prev) == restarted
    assert rate(12.0, 2.0, 5.0) == 2.0 and rate(3.0, 10.0, 1.0) == 3.0 and rate(None, 1.0, 1.0) is None


def test_scrape_sums_and_splits_by_label() -> None:
    s = Scrape("u", 0.0, parse(TEXT))
    assert s.total("banyan:request_success_total") == 7.0
    assert s.total("banyan:request_success_total", finish_reason="error") == 2.0
    assert s.by_label("banyan:request_success_total", "finish_reason") == {"stop": 5.0, "error": 2.0}
    assert s.total("banyan:nothing") is None


def test_ready_file_layout(tmp_path) -> None:
    one = tmp_path / "one"
    one.write_text("50051\n8000\n9100\n9200\n")
    e = top.from_ready_file(str(one))
    assert (e.tokenizer, e.schedulers, e.workers) == ("http://127.0.0.1:8000/metrics", ("http://127.0.0.1:9100/metrics",),
                                                      ("http://127.0.0.1:9200/metrics",))
    dp = tmp_path / "dp"
    dp.write_text("50051\n-1\n9100\n9200\n9100,9101\n9200,0\n")
    e = top.from_ready_file(str(dp), "10.0.0.5")
    assert e.tokenizer == "" and e.schedulers == ("http://10.0.0.5:9100/metrics", "http://10.0.0.5:9101/metrics")
    assert e.workers == ("http://10.0.0.5:9200/metrics", "")
    bad = tmp_path / "bad"
    bad.write_text("50051\n")
    with pytest.raises(ValueError, match="not a banyan serve ready file"):
        top.from_ready_file(str(bad))


def test_flashinfer_kernel_sources(tmp_path) -> None:
    assert check_env.flashinfer_kernels(str(tmp_path), "0.6.18", None).status == "ok"
    assert check_env.flashinfer_kernels(str(tmp_path), None, "/usr/bin/nvcc").status == "warn"
    none = check_env.flashinfer_kernels(str(tmp_path), None, None)
    assert none.status == "fail" and "--attention-backend torch" in none.detail
    (tmp_path / "90a" / "cached_ops" / "batch_decode").mkdir(parents=True)
    (tmp_path / "90a" / "cached_ops" / "batch_decode" / "batch_decode.so").write_bytes(b"\x7fELF")
    row = check_env.flashinfer_kernels(str(tmp_path), None, None)
    assert row.status == "ok" and "1 compiled kernels" in row.detail


def test_cache_rows_warn_where_a_gpu_worker_could_not_write(tmp_path, monkeypatch) -> None:
    blocked = tmp_path / "a-file"
    blocked.write_text("")  # (a path under a file: not writable, even for root)
    monkeypatch.setenv("BANYAN_KERNEL_CACHE", str(blocked / "kernels"))
    monkeypatch.setenv("BANYAN_TUNING_CACHE", str(blocked / "tuning"))
    rows = {r.check: r for r in check_env.check_caches(gpu=True)}
    assert rows["kernel cache"].status == "warn" and "BANYAN_KERNEL_CACHE" in rows["kernel cache"].detail
    assert rows["tuning cache"].status == "warn" and "BANYAN_TUNING_CACHE" in rows["tuning cache"].detail
    assert {r.status for r in check_env.check_caches(gpu=False)} == {"info"}  # (a CPU host uses neither)
    monkeypatch.setenv("BANYAN_KERNEL_CACHE", str(tmp_path / "k" / "kernels"))
    monkeypatch.setenv("BANYAN_TUNING_CACHE", str(tmp_path / "t"))
    rows = {r.check: r for r in check_env.check_caches(gpu=True)}
    assert rows["kernel cache"].status == rows["tuning cache"].status == "ok"
    assert "empty" in rows["kernel cache"].detail and "empty" in rows["tuning cache"].detail
    (tmp_path / "k" / "kernels").mkdir(parents=True)
    (tmp_path / "k" / "kernels" / "gemv_sm_90a_bf16_0.so").write_bytes(b"\x7fELF")
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "0123.json").write_text("{}")
    rows = {r.check: r for r in check_env.check_caches(gpu=True)}
    assert "1 built" in rows["kernel cache"].detail and "1 decision files" in rows["tuning cache"].detail
    monkeypatch.setenv("BANYAN_TUNING_CACHE", "0")
    assert {r.check: r for r in check_env.check_caches(gpu=True)}["tuning cache"].status == "info"


def test_port_check_sees_a_listening_socket_even_with_reuseport() -> None:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)  # as our servers bind
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        row = check_env.check_port("grpc", "127.0.0.1", port)
        assert row.status == "fail" and f"127.0.0.1:{port}" in row.detail and "--grpc-port" in row.detail
    assert check_env.check_port("grpc", "127.0.0.1", port).status == "ok"
    assert check_env.check_port("http", "127.0.0.1", -1).status == "info"


def test_help_lists_every_command_and_version_prints() -> None:
    run = lambda *a: subprocess.run([sys.executable, "-m", "banyan.cli", *a], cwd=ROOT, capture_output=True,  # noqa: E731
                                    text=True, timeout=60)
    r = run("--help")
    assert r.returncode == 0
    from banyan.cli import COMMANDS

    for name in COMMANDS:
        assert any(line.split()[:1] == [name] for line in r.stdout.splitlines()), name
    assert {"serve", "check-env", "top", "bench"} <= set(COMMANDS)
    v = run("--version")
    assert v.returncode == 0 and v.stdout.startswith("banyan ") and len(v.stdout.split()) == 2
    bad = run("frobnicate")
    assert bad.returncode == 2 and "unknown command 'frobnicate'" in bad.stderr and "check-env" in bad.stderr
