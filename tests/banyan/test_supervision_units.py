"""The launcher's supervision parts without a server: restart policy and counter, run directories
(sweep, owners), the fixed-port check, services dying with their launcher (parent-death signal and
the parent-pid watch), one-line configuration errors, model names and hub ids."""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from banyan import cli, rundir
from banyan.ports import FixedPort, PortBusy, PortReservations, check_free, free_port
from banyan.supervision import MAX_BACKOFF_S, RestartCounter, RestartPolicy
from shared.config import CommonConfig, ConfigError, SchedulerConfig, TokenizerConfig, add_arguments, from_namespace
from shared.entry import as_flags
from shared.model_path import resolve_model
from tests.support import ROOT

WAIT_S = 30.0  # bound on waits for something that must happen (not a timing claim)
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


# ---- restarts ------------------------------------------------------------------------------------
def test_restart_policy_backs_off_and_names_a_crash_loop():
    now = [0.0]
    policy = RestartPolicy(4, 600.0, clock=lambda: now[0])
    delays = [policy.exited("scheduler", ran_s=3600.0).delay_s]  # ran for an hour: at once
    for _ in range(3):  # then it keeps dying young: at once, 1 s, 2 s
        now[0] += 5
        v = policy.exited("scheduler", ran_s=4.0)
        assert v.restart
        delays.append(v.delay_s)
    assert delays == [0.0, 0.0, 1.0, 2.0] and policy.used("scheduler") == 4
    assert policy.exited("tokenizer-1", ran_s=1.0).restart  # another unit has its own budget
    now[0] += 5
    out = policy.exited("scheduler", ran_s=4.0)
    assert not out.restart and out.reason.startswith("a crash loop (4 exits in a row within 60 s of the start)")
    assert "it exited 5 times within 600 s" in out.reason and "--max-restarts 4" in out.reason
    now[0] += 600  # the window moved on: restarts again
    assert policy.exited("scheduler", ran_s=4.0).restart
    long = RestartPolicy(10, 600.0, clock=lambda: now[0])
    assert [long.exited("w", 1.0).delay_s for _ in range(7)][-1] == MAX_BACKOFF_S
    assert RestartPolicy(0, 600.0).exited("w", 1.0).reason == "restarts are off (--max-restarts 0)"


def test_restart_counter_is_summed_by_the_tokenizers_scrape(tmp_path):
    counter = RestartCounter(str(tmp_path), ["scheduler", "tokenizer-0"])
    counter.inc("scheduler")
    counter.inc("scheduler")
    counter.inc("worker-0")
    counter.close()
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(tmp_path))  # what a tokenizer's /metrics reads
    text = generate_latest(registry).decode()
    assert 'banyan:service_restarts_total{service="scheduler"} 2.0' in text
    assert 'banyan:service_restarts_total{service="worker-0"} 1.0' in text
    assert 'banyan:service_restarts_total{service="tokenizer-0"} 0.0' in text


# ---- run directories -----------------------------------------------------------------------------
def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def fake_run_dir(root: Path, name: str, owner: dict | None) -> Path:
    d = root / name
    d.mkdir()
    (d / "scheduler.ipc").write_text("")
    if owner is not None:
        (d / "owner").write_text(json.dumps(owner))
    return d


def test_sweep_removes_only_run_dirs_whose_launcher_is_gone(tmp_path):
    mine = rundir.RunDir([50051], root=str(tmp_path))  # this process: alive
    me = os.getpid()
    dead = fake_run_dir(tmp_path, "banyan-1-dead", {"pid": dead_pid(), "start": "", "ports": []})
    reused = fake_run_dir(tmp_path, "banyan-2-reused", {"pid": me, "start": "1", "ports": []})  # my pid, not me
    parent = fake_run_dir(tmp_path, "banyan-3-parent",
                          {"pid": os.getppid(), "start": rundir.process_start(os.getppid())})
    ownerless = fake_run_dir(tmp_path, "banyan-4-other", None)  # not a run dir of ours
    unrelated = fake_run_dir(tmp_path, "other-5", {"pid": dead_pid()})
    assert sorted(rundir.sweep(str(tmp_path))) == sorted([str(dead), str(reused)])
    for kept in (Path(mine.path), parent, ownerless, unrelated):
        assert kept.exists()
    assert Path(mine.path).name.startswith(f"banyan-{me}-") and oct(Path(mine.path).stat().st_mode)[-3:] == "700"
    assert rundir.owner_of_port(50051, str(tmp_path)).pid == me and rundir.owner_of_port(8000, str(tmp_path)) is None
    mine.remove()
    assert not Path(mine.path).exists()


# ---- ports ---------------------------------------------------------------------------------------
def test_fixed_port_check_names_the_port_its_holder_and_the_way_out(tmp_path):
    stranger = socket.socket()  # another program listening on the port
    stranger.bind(("127.0.0.1", 0))
    stranger.listen()
    port = stranger.getsockname()[1]
    try:
        with pytest.raises(PortBusy) as e:
            check_free([FixedPort(port, "--grpc-port")], str(tmp_path))
        assert str(e.value) == (f"port {port} (--grpc-port) is in use by another program: stop it or pick another "
                                f"with --grpc-port (0: any free port)")
    finally:
        stranger.close()
    held = PortReservations()  # another Banyan: holds the port, and its run directory lists it
    port = held.hold(free_port())
    other = rundir.RunDir([port], root=str(tmp_path))
    try:
        with pytest.raises(PortBusy) as e:
            check_free([FixedPort(port, "--http-port")], str(tmp_path))
        busy = f"port {port} (--http-port) is in use by another Banyan server (launcher pid {os.getpid()})"
        assert busy in str(e.value)
        assert f"kill {os.getpid()}" in str(e.value)
    finally:
        held.release()
        other.remove()
    check_free([FixedPort(port, "--http-port")], str(tmp_path))  # released: free


def test_a_port_left_in_time_wait_by_a_killed_server_is_free(tmp_path):
    """A server killed with connections open leaves them in TIME_WAIT on its port: the check (and
    a new server's listeners, SO_REUSEADDR like gRPC's) bind it all the same."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    conn, _ = listener.accept()
    conn.close()  # the server side closes first: its end goes to TIME_WAIT
    listener.close()
    client.recv(1)
    client.close()
    check_free([FixedPort(port, "--grpc-port")], str(tmp_path))


# ---- dying with the launcher ---------------------------------------------------------------------
LAUNCHER = """
import os, subprocess, sys
env = dict(os.environ, BANYAN_LAUNCHER_PID=str(os.getpid()))
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], env=env, stdout=subprocess.PIPE, text=True)
print(child.pid, child.stdout.readline().strip(), flush=True)  # (the child's pid, how it tied itself)
import time; time.sleep(120)
"""
SERVICE = """
import os, sys, time
from shared.entry import tie_to_launcher, watch_parent
if sys.argv[1:] == ["watch"]:
    how = "watch"
    watch_parent(os.getppid(), 0.05)
else:
    how = tie_to_launcher()
print(how, os.environ.get("BANYAN_LAUNCHER_PID", "-"), flush=True)
time.sleep(120)
"""


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie holds nothing
    except FileNotFoundError:
        return True


@pytest.mark.parametrize("mode", ["prctl", "watch"])
def test_a_service_dies_with_its_launcher(mode):
    code = SERVICE if mode == "prctl" else SERVICE.replace("sys.argv[1:]", '["watch"]')
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, code], env=ENV, stdout=subprocess.PIPE, text=True)
    try:
        pid, how = launcher.stdout.readline().split(" ", 1)
        child = int(pid)
        assert how.split()[0] == mode
        if mode == "prctl":
            assert how.split()[1] == "-"  # the variable is not passed on to the service's children
        assert not gone(child)
        launcher.kill()  # kill -9: nothing of the launcher runs any more
        launcher.wait()
        deadline = time.monotonic() + WAIT_S
        while not gone(child):
            assert time.monotonic() < deadline, f"the service outlived its launcher by {WAIT_S} s"
            time.sleep(0.02)
    finally:
        launcher.kill()
        launcher.wait()


def test_not_started_by_a_launcher_nothing_is_tied():
    out = subprocess.run([sys.executable, "-c", SERVICE.replace("time.sleep(120)", "")], env=ENV,
                         capture_output=True, text=True, timeout=WAIT_S)
    assert out.returncode == 0 and out.stdout.split() == ["-"]  # how: "" (nothing tied)


# ---- configuration errors, names, models ---------------------------------------------------------
def banyan(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "banyan.cli", *args], env={**ENV, **env}, capture_output=True,
                          text=True, timeout=120, cwd=ROOT)


@pytest.mark.parametrize("args, says", [
    (["serve", "--log-level", "verbose"], "--log-level 'verbose' is not one of debug | info | warning | error"),
    (["serve", "--max-running-requests", "many"], "argument --max-running-requests: invalid int value: 'many'"),
    (["serve", "--model", "nobody/no-such-model"], "the local Hugging Face cache"),
    (["worker", "--model", "/no/such/dir"], "--model '/no/such/dir' is neither a directory nor a Hugging Face hub id"),
])
def test_configuration_errors_are_one_line(args, says, tmp_path):
    out = banyan(*args, HF_HUB_CACHE=str(tmp_path))
    assert out.returncode == 2, out
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0] and lines[0].startswith(f"banyan {args[0]}: error: "), out.stderr
    if "Hugging Face cache" in says:
        assert "never downloads" in lines[0] and str(tmp_path) in lines[0]


def test_debug_shows_the_traceback():
    out = banyan("serve", "--log-level", "verbose", "--debug")
    assert out.returncode != 0 and "Traceback" in out.stderr and "ConfigError" in out.stderr


def test_as_flags_names_fields_as_flags():
    assert as_flags("max_running_requests must be >= 1", SchedulerConfig) == "--max-running-requests must be >= 1"
    assert as_flags("not_a_field stays", SchedulerConfig) == "not_a_field stays"


def test_a_hub_id_resolves_from_the_local_cache_only(tmp_path, demo_dir, monkeypatch):
    from huggingface_hub import constants

    snap = tmp_path / "models--acme--tiny" / "snapshots" / "0123abcd"
    snap.mkdir(parents=True)
    (tmp_path / "models--acme--tiny" / "refs").mkdir()
    (tmp_path / "models--acme--tiny" / "refs" / "main").write_text("0123abcd")
    for f in Path(demo_dir).iterdir():
        (snap / f.name).symlink_to(f)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_model("acme/tiny") == (str(snap), "acme/tiny")  # named by its id
    with pytest.raises(ConfigError, match="'acme/other' is no directory"):
        resolve_model("acme/other")
    assert resolve_model(demo_dir) == (demo_dir, Path(demo_dir).name)
    with pytest.raises(ConfigError, match="--model is empty"):
        resolve_model("")


def test_served_model_names_repeat_and_the_demo_is_resolved_for_single_services(monkeypatch, demo_dir):
    ap = argparse.ArgumentParser()
    add_arguments(ap, TokenizerConfig)
    ns = ap.parse_args(["--served-model-name", "first", "--served-model-name", "alias"])
    assert from_namespace(TokenizerConfig, ns).served_model_names == ["first", "alias"]
    monkeypatch.setenv("BANYAN_SERVED_MODEL_NAME", "env-a,env-b")
    ap = argparse.ArgumentParser()
    add_arguments(ap, CommonConfig)
    assert from_namespace(CommonConfig, ap.parse_args([])).served_model_names == ["env-a", "env-b"]
    assert from_namespace(CommonConfig, ap.parse_args(["--served-model-name", "x"])).served_model_names == ["x"]
    monkeypatch.delenv("BANYAN_SERVED_MODEL_NAME")
    monkeypatch.delenv("BANYAN_MODEL", raising=False)

    seen = []

    class Service:
        @staticmethod
        def main(argv):
            seen.append(argv)

    monkeypatch.setattr("importlib.import_module", lambda name: Service)
    monkeypatch.setattr(cli, "resolve", lambda model: (demo_dir, cli.DEMO_NAME))
    cli.run_service("worker", ["--device", "cpu"])
    cli.run_service("tokenizer", ["--served-model-name", "mine"])
    cli.run_service("scheduler", ["--model", demo_dir])
    assert seen == [["--device", "cpu", "--model", demo_dir, "--served-model-name", "banyan-demo"],
                    ["--served-model-name", "mine", "--model", demo_dir], ["--model", demo_dir]]


def test_nothing_in_shared_or_services_imports_banyan():
    import ast

    found = []
    for top in ("shared", "services"):
        for path in (ROOT / top).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module or ""] if isinstance(node, ast.ImportFrom) else []
                found += [f"{path.relative_to(ROOT)}: {n}" for n in names if n == "banyan" or n.startswith("banyan.")]
    assert not found, found



# ---- stopping ------------------------------------------------------------------------------------
STUBBORN = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(60)"


def test_a_second_ctrl_c_stops_at_once_and_a_second_sigterm_does_not(capsys):
    from banyan.launcher import Child, Launcher, ServeConfig
    from shared.config import WorkerConfig

    def launcher() -> Launcher:
        la = Launcher(ServeConfig(TokenizerConfig(grace_seconds=5), SchedulerConfig(), WorkerConfig()))
        for name in ("tokenizer-0", "scheduler"):  # processes that ignore SIGTERM, as a stuck service would
            p = subprocess.Popen([sys.executable, "-c", STUBBORN], stdout=subprocess.PIPE, text=True)
            assert p.stdout.readline() == "up\n"
            la.children[name] = Child(name, p, time.monotonic())
        return la

    la = launcher()
    la._on_signal(signal.SIGINT, None)  # Ctrl-C: stop in order …
    procs = [c.proc for c in la.children.values()]
    threading.Timer(0.5, la._on_signal, (signal.SIGINT, None)).start()  # … Ctrl-C again
    t0 = time.monotonic()
    assert la.shutdown() is False
    assert time.monotonic() - t0 < 5 + 5  # before the tokenizers' grace (+5 s) ran out
    assert [p.returncode for p in procs] == [-signal.SIGKILL] * 2
    err = capsys.readouterr().err
    assert "Press Ctrl-C again to stop at once" in err and "Banyan is stopping at once" in err

    la = launcher()
    la._on_signal(signal.SIGTERM, None)
    la._on_signal(signal.SIGTERM, None)  # a supervisor repeating SIGTERM: still in order
    assert not la.at_once
    for c in la.children.values():
        c.proc.kill()
    la.shutdown()
