"""Faults injected into a live ``banyan serve`` (``--num-tokenizers 2``) under a steady streaming
load, and how the server recovers: ``kill -9`` of the scheduler, of the worker, of one tokenizer
replica (``--rounds`` each, in turn), then of the launcher itself (``--launcher-rounds`` times, each
followed by a fresh server on the same ports).

Per fault it records the recovery time — scheduler/worker: kill → a new request served again (it
waits for the group, or is refused and retried); tokenizer: kill → the restarted replica serving
(the launcher's ``tokenizer_serving_again``); launcher: kill → every service process gone — and
the requests lost: streams that failed, next to the streams in flight on what was killed (a
scheduler's or worker's group holds all of them, a replica those it received). At the end: the
processes left behind (every process the launchers started, still running) and the run
directories left (``banyan-*`` in the run's TMPDIR).

    python -m benchmarks.bench_supervision --rounds 5 --launcher-rounds 3 --out benchmarks/results/supervision_cpu.json

Prints a table (per kind: faults, recovery p50/p99, streams in flight, lost) and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.support import Server, free_port  # noqa: E402
from shared.proto.banyan.v1 import generation_pb2 as pb  # noqa: E402
from shared.proto.banyan.v1 import generation_pb2_grpc as pb_grpc  # noqa: E402


class Load:
    """``streams`` greedy streams kept running, each on its own connection, restarted as they end."""

    def __init__(self, server: Server, streams: int, tokens: int) -> None:
        self.server, self.tokens = server, tokens
        self.lock = threading.Lock()
        self.live: dict[str, float] = {}  # request id → start
        self.ended: list[tuple[str, float, str, bool]] = []  # (request id, when, "ok" or the status, had streamed)
        self.stop = False
        self.n = 0
        self.threads = [threading.Thread(target=self._loop, daemon=True) for _ in range(streams)]
        for t in self.threads:
            t.start()

    def _loop(self) -> None:
        while not self.stop:
            with self.lock:
                self.n += 1
                rid = f"load-{self.n}"
            with self.server.channel(own_connection=True) as ch:
                req = pb.GenerateRequest(text=f"load {rid}", request_id=rid, sampling_params=pb.SamplingParams(
                    max_tokens=self.tokens, temperature=0.0, ignore_eos=True))
                how, streamed = "ok", False
                try:
                    for i, _ in enumerate(pb_grpc.GenerationServiceStub(ch).Generate(req, timeout=600)):
                        if i == 0:
                            streamed = True
                            with self.lock:
                                self.live[rid] = time.monotonic()
                except grpc.RpcError as e:
                    how = e.code().name
            with self.lock:
                self.live.pop(rid, None)
                self.ended.append((rid, time.monotonic(), how, streamed))
            if how != "ok":
                time.sleep(0.2)

    def in_flight(self) -> list[str]:
        with self.lock:
            return list(self.live)

    def failed_since(self, t: float, streamed: bool) -> list[str]:
        """Requests that failed since ``t``: those that had streamed (lost), or not (refused)."""
        with self.lock:
            return [rid for rid, when, how, s in self.ended if when >= t and how != "ok" and s == streamed]

    def close(self) -> None:
        self.stop = True
        for t in self.threads:
            t.join(600)


def started(server: Server) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for r in server.log_records():
        if r.get("event") == "started" and r.get("service") == "launcher":
            out.setdefault(r["process"], []).append(r["pid"])
    return out


def running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def served(server: Server, timeout: float = 300) -> float:
    """Until one new greedy request is served (retried while refused); when."""
    deadline = time.monotonic() + timeout
    while True:
        with server.channel(own_connection=True) as ch:
            req = pb.GenerateRequest(text="probe", sampling_params=pb.SamplingParams(max_tokens=4, temperature=0.0))
            try:
                list(pb_grpc.GenerationServiceStub(ch).Generate(req, timeout=timeout))
                return time.monotonic()
            except grpc.RpcError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)


def replica_of(server: Server, rids: list[str]) -> dict[str, int]:
    want = set(rids)
    return {r["request_id"]: r["pid"] for r in server.log_records()
            if r.get("stage") == "received" and r.get("request_id") in want}


def fault(server: Server, load: Load, kind: str) -> dict:
    pids = started(server)
    name = {"scheduler": "scheduler", "worker": "worker-0", "tokenizer": "tokenizer-1"}[kind]
    victim = pids[name][-1]
    flight = load.in_flight()
    holders = replica_of(server, flight) if kind == "tokenizer" else {}
    exposed = [r for r in flight if holders.get(r) == victim] if kind == "tokenizer" else flight
    before = len([r for r in server.log_records() if r.get("event") == "tokenizer_serving_again"])
    os.kill(victim, signal.SIGKILL)
    t0 = time.monotonic()
    if kind == "tokenizer":
        deadline = t0 + 300
        while True:
            back = [r for r in server.log_records() if r.get("event") == "tokenizer_serving_again"]
            if len(back) > before:
                recovery = back[-1]["down_s"]
                break
            assert time.monotonic() < deadline, "the replica never came back"
            time.sleep(0.05)
    else:
        recovery = served(server) - t0
    time.sleep(1.0)  # let the failures of the kill arrive
    lost = load.failed_since(t0, streamed=True)
    return {"kind": kind, "recovery_s": recovery, "in_flight": len(flight), "exposed": len(exposed),
            "lost": len(lost), "lost_not_exposed": len(set(lost) - set(exposed)),
            "refused": len(load.failed_since(t0, streamed=False))}


def launcher_fault(server: Server, load: Load) -> tuple[dict, list[int]]:
    pids = [p for ps in started(server).values() for p in ps if running(p)]
    flight = load.in_flight()
    server.proc.kill()
    t0 = time.monotonic()
    while any(running(p) for p in pids) and time.monotonic() - t0 < 60:
        time.sleep(0.01)
    gone = time.monotonic() - t0
    return {"kind": "launcher", "recovery_s": gone, "in_flight": len(flight), "exposed": len(flight),
            "lost": len(flight), "lost_not_exposed": 0, "refused": 0}, pids


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="faults of each service kind")
    ap.add_argument("--launcher-rounds", type=int, default=2)
    ap.add_argument("--streams", type=int, default=8, help="streams kept running")
    ap.add_argument("--tokens", type=int, default=300, help="tokens per stream")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    os.environ.setdefault("BANYAN_CACHE_DIR", str(Path.home() / ".cache" / "banyan"))
    rows: list[dict] = []
    every_pid: list[int] = []
    with tempfile.TemporaryDirectory(prefix="bsup") as tmp:
        root = Path(tmp)
        ports = ["--grpc-port", str(free_port()), "--http-port", str(free_port())]
        flags = [*ports, "--num-tokenizers", "2", "--max-restarts", str(3 * args.rounds + 3)]
        starts = []
        for r in range(args.launcher_rounds + 1):
            t0 = time.monotonic()
            server = Server(None, root / f"server-{r}.log", *flags, env={"TMPDIR": tmp})
            starts.append(time.monotonic() - t0)
            load = Load(server, args.streams, args.tokens)
            try:
                time.sleep(2)
                if r == 0:
                    for _ in range(args.rounds):
                        for kind in ("scheduler", "worker", "tokenizer"):
                            rows.append(fault(server, load, kind))
                            print(json.dumps(rows[-1]), flush=True)
                            time.sleep(1)
                if r < args.launcher_rounds:
                    row, pids = launcher_fault(server, load)
                    rows.append(row)
                    every_pid += pids
                    print(json.dumps(rows[-1]), flush=True)
                else:
                    every_pid += [p for ps in started(server).values() for p in ps]
            finally:
                load.close()
                server.stop()
        left = [p for p in every_pid if running(p)]
        dirs = [p.name for p in root.glob("banyan-*")]
    kinds = {}
    for kind in ("scheduler", "worker", "tokenizer", "launcher"):
        rs = [r for r in rows if r["kind"] == kind]
        if rs:
            rec = [r["recovery_s"] for r in rs]
            kinds[kind] = {"faults": len(rs), "recovery_p50_s": statistics.median(rec),
                           "recovery_p99_s": pct(rec, 0.99),
                           **{k: sum(r[k] for r in rs) for k in ("in_flight", "exposed", "lost", "lost_not_exposed",
                                                                 "refused")}}
    print(f"\n{'fault (kill -9)':<16}{'n':>3}{'recovery p50':>14}{'p99':>8}{'in flight':>11}{'on it':>7}{'lost':>6}"
          f"{'others lost':>13}{'refused':>9}")
    for kind, k in kinds.items():
        print(f"{kind:<16}{k['faults']:>3}{k['recovery_p50_s']:>13.2f}s{k['recovery_p99_s']:>7.2f}s{k['in_flight']:>11}"
              f"{k['exposed']:>7}{k['lost']:>6}{k['lost_not_exposed']:>13}{k['refused']:>9}")
    print("recovery: scheduler/worker kill → a new request served; tokenizer kill → the replica serving again; "
          "launcher kill → every service process gone. lost: streams that failed mid-stream; others lost: of those, "
          "ones not in flight on the killed process at the kill; refused: new requests refused before streaming "
          "(UNAVAILABLE while a group restarts, retried)")
    print(f"server starts: {', '.join(f'{s:.1f} s' for s in starts)} (after a launcher kill: same ports)")
    print(f"processes left behind: {len(left)}; run directories left: {len(dirs)}")
    if args.out:
        args.out.write_text(json.dumps({"benchmark": "supervision", "cpus": os.cpu_count(), "rounds": args.rounds,
                                        "streams": args.streams, "tokens": args.tokens, "kinds": kinds,
                                        "faults": rows, "server_starts_s": starts, "processes_left": len(left),
                                        "run_dirs_left": dirs}, indent=1) + "\n")
    return 0 if not left and not dirs else 1


if __name__ == "__main__":
    sys.exit(main())
