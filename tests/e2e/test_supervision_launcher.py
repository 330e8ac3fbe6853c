"""The launcher killed hard (``kill -9``) while 32 streams run: every service process is gone within
5 s (the parent-death signal), the gRPC and HTTP ports are free, and a new server on the same ports
serves (sweeping the dead launcher's run directory away). A second ``banyan serve`` on those busy
ports exits 1 within 10 s with one line naming the port and the first server, which is untouched;
a clean SIGTERM stop leaves no process and no run directory."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from grpc_health.v1 import health_pb2

from banyan.ports import FixedPort, check_free
from tests.e2e.test_worker_death import greedy, health, open_streams, started
from tests.support import ROOT, Server, free_port
from shared.proto.banyan.v1 import generation_pb2_grpc as pb_grpc

BOUND_S = 5.0  # the bound: launcher killed → every service process gone


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (from /proc)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie holds nothing
    except FileNotFoundError:
        return False


def test_launcher_killed_hard_takes_everything_with_it(demo_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("t")  # TMPDIR of both servers: where their run directories go
    logs = tmp_path_factory.mktemp("log")
    port, http_port = free_port(), free_port()
    ports = ("--grpc-port", str(port), "--http-port", str(http_port))
    env = {"TMPDIR": str(root)}
    t0 = time.monotonic()
    first = Server(None, logs / "first.log", *ports, env=env)
    first_start = time.monotonic() - t0
    try:
        with first.channel() as ch:
            streams = open_streams(first, pb_grpc.GenerationServiceStub(ch), n_grpc=24, n_http=8)
            tree = descendants(first.proc.pid)
            names = started(first)
            assert {p for ps in names.values() for p in ps} <= set(tree) and len(names) == 3, (names, tree)
            [old_dir] = root.glob("banyan-*")
            first.proc.kill()
            killed_at = time.monotonic()
            while any(running(p) for p in tree):
                assert time.monotonic() - killed_at < BOUND_S, \
                    f"still running {BOUND_S} s after the launcher was killed: {[p for p in tree if running(p)]}"
                time.sleep(0.02)
            all_gone = time.monotonic() - killed_at
            for st in streams:  # they broke with the server (how is not the point here)
                st.thread.join(30)
                assert not st.thread.is_alive()
    finally:
        first.stop()
    check_free([FixedPort(port, "--grpc-port"), FixedPort(http_port, "--http-port")])  # the ports are free
    assert old_dir.exists()  # its launcher could not remove it …

    t0 = time.monotonic()
    second = Server(None, logs / "second.log", *ports, env=env)
    second_start = time.monotonic() - t0
    try:
        assert not old_dir.exists()  # … the next start swept it away
        swept = [r for r in second.log_records() if r.get("event") == "run_dir_swept"]
        assert [r["path"] for r in swept] == [str(old_dir)]
        with second.channel() as ch:
            stub = pb_grpc.GenerationServiceStub(ch)
            before = greedy(stub)
            t0 = time.monotonic()
            third = subprocess.run([sys.executable, "-m", "banyan.cli", "serve", *ports], capture_output=True,
                                   text=True, timeout=60, cwd=ROOT,
                                   env={**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(root)})
            refused_in = time.monotonic() - t0
            assert third.returncode == 1 and refused_in < 10, (third.returncode, refused_in, third.stderr)
            lines = third.stderr.strip().splitlines()
            assert len(lines) == 1 and "Traceback" not in third.stderr, third.stderr
            assert lines[0] == (f"banyan serve: error: port {port} (--grpc-port) is in use by another Banyan server "
                                f"(launcher pid {second.proc.pid}): stop it (kill {second.proc.pid}) or pick "
                                f"another with --grpc-port (0: any free port)")
            assert health(second) == health_pb2.HealthCheckResponse.SERVING and greedy(stub) == before  # untouched
        pids = [p for ps in started(second).values() for p in ps]
    finally:
        assert second.stop() == 0, second.log_text()[-3000:]  # SIGTERM: a clean stop
    for pid in pids:
        assert not running(pid)
    assert not list(root.glob("banyan-*")), list(root.iterdir())  # no run directory left
    print(f"\nlauncher kill -9 with {len(streams)} streams: {len(tree)} service processes gone in {all_gone:.3f} s; "
          f"start {first_start:.1f} s, on the same ports again {second_start:.1f} s; a second serve refused "
          f"in {refused_in:.1f} s")
