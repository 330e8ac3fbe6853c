"""``banyan serve``: start the scheduler, the worker ranks and N tokenizer replicas on one host
(``--dp N``: N scheduler + worker groups, every tokenizer connected to all of them), supervise
them, and stop them in order (tokenizers drain first) on SIGINT/SIGTERM. A worker rank that exits
once serving has its group restarted (``--max-worker-restarts``); any other exit stops everything."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace

from shared.config import SchedulerConfig, TokenizerConfig, WorkerConfig, to_argv
from shared.logging import get_logger
from shared.model_path import resolve_model
from banyan.supervision import RestartBudget, how_it_ended, worker_group

log = get_logger("launcher")
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"  # prometheus_client's multiprocess mode (the tokenizers')


@dataclass(frozen=True)
class ServeConfig:
    tokenizer: TokenizerConfig
    scheduler: SchedulerConfig
    worker: WorkerConfig
    num_tokenizers: int = 1
    ready_file: str = ""
    startup_timeout: float = 600.0
    scheduler_metrics_port: int = 0  # Prometheus /metrics of the scheduler: 0 = a free port, -1 = none
    worker_metrics_port: int = 0  # … of worker rank 0
    dp: int = 1  # data-parallel groups: one scheduler + tp worker ranks each, own endpoints and KV pool
    max_worker_restarts: int = 3  # worker-group restarts (after a rank exits) within worker_restart_window
    worker_restart_window: float = 600.0  # seconds


def _metrics_port(port: int, reserve: PortReservations, group: int = 0) -> int:
    """A service's ``metrics_port`` (0 = off) from a launcher setting (0 = a free port, -1 = off;
    a fixed port is group 0's, group g gets port + g)."""
    if port == 0:
        return reserve.take()
    return port + group if port > 0 else 0


def _group_gpus(worker: WorkerConfig, dp: int) -> list[dict[str, str]]:
    """Per group, the environment of its worker ranks: with dp > 1 on CUDA (device auto or cuda),
    its own tp_size GPUs through CUDA_VISIBLE_DEVICES; nothing otherwise (an explicit cuda:N or
    cpu is used by every group as given)."""
    if dp == 1 or worker.device not in ("auto", "cuda"):
        return [{} for _ in range(dp)]
    import torch

    count = torch.cuda.device_count()
    if count == 0 and worker.device == "auto":
        return [{} for _ in range(dp)]
    need = dp * worker.tp_size
    if count < need:
        raise RuntimeError(f"--dp {dp} × --tp {worker.tp_size} needs {need} GPUs; {count} are visible")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else [str(i) for i in range(count)]
    tp = worker.tp_size
    return [{"CUDA_VISIBLE_DEVICES": ",".join(ids[g * tp:(g + 1) * tp])} for g in range(dp)]


def group_endpoint(endpoint: str, g: int) -> str:
    """Group ``g``'s copy of a ZMQ endpoint every group binds: tcp port + g, an ipc path + "-g"."""
    if not endpoint or g == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        host, port = endpoint.rsplit(":", 1)
        return f"{host}:{int(port) + g}"
    return f"{endpoint}-{g}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PortReservations:
    """Ports the launcher picks for its services, held while they run. A port from
    ``free_port()`` is free only at that instant: seconds pass before a tokenizer binds it, and another
    process can take it meanwhile (the tokenizer then fails with EADDRINUSE). A reservation is a
    bound, never listening, ``SO_REUSEPORT`` socket on the wildcard address: the kernel hands the
    port to no one else, while our services (they bind with ``SO_REUSEPORT`` too, same user) can."""

    def __init__(self) -> None:
        self._socks: list[socket.socket] = []

    def take(self) -> int:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        s.bind(("0.0.0.0", 0))
        self._socks.append(s)
        return s.getsockname()[1]

    def release(self) -> None:
        for s in self._socks:
            s.close()
        self._socks.clear()


def _secrets_to_env(argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """Move ``--api-key`` from a child's argv (visible to every local user in ``ps``) into its
    environment (``BANYAN_API_KEY``)."""
    env = dict(os.environ)
    if "--api-key" in argv:
        i = argv.index("--api-key")
        env["BANYAN_API_KEY"] = argv[i + 1]
        argv = argv[:i] + argv[i + 2:]
    return argv, env


class Launcher:
    def __init__(self, cfg: ServeConfig) -> None:
        self.cfg = cfg
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.spawned: dict[str, tuple[str, object, dict[str, str] | None]] = {}  # name → how to start it again
        self.restarts = RestartBudget(cfg.max_worker_restarts, cfg.worker_restart_window)
        self.stopping = False
        self.ports = PortReservations()

    def _spawn(self, name: str, module: str, cfg, extra_env: dict[str, str] | None = None) -> None:
        argv, env = _secrets_to_env(to_argv(cfg))
        for var in (MULTIPROC_ENV, MULTIPROC_ENV.lower()):  # only the tokenizers share a metrics directory
            env.pop(var, None)
        env.update(extra_env or {})
        p = subprocess.Popen([sys.executable, "-m", module, *argv], start_new_session=True, env=env)
        self.procs.append((name, p))
        self.spawned[name] = (module, cfg, extra_env)
        log.info("started", process=name, pid=p.pid)

    def run(self) -> int:
        cfg = self.cfg
        resolve_model(cfg.worker.model)  # builds the demo model once, before the services start
        try:
            gpus = _group_gpus(cfg.worker, cfg.dp)
        except RuntimeError as e:
            log.error("bad_dp", error=str(e))
            return 1
        run_dir = tempfile.mkdtemp(prefix="banyan-")
        reserve = self.ports  # held for the launcher's life: a restarted worker binds its metrics port again
        port = cfg.tokenizer.grpc_port or reserve.take()
        http_port = cfg.tokenizer.http_port or reserve.take()  # -1 (no HTTP) stays
        smg_port = cfg.tokenizer.smg_grpc_port or reserve.take()  # -1 (SMG's service on the gRPC port) stays
        sched_metrics = [_metrics_port(cfg.scheduler_metrics_port, reserve, g) for g in range(cfg.dp)]
        worker_metrics = [_metrics_port(cfg.worker_metrics_port, reserve, g) for g in range(cfg.dp)]
        # tokenizer replicas write their metrics here; a scrape of any of them sums all (multiprocess mode)
        metrics_dir = os.path.join(run_dir, "tokenizer-metrics")
        os.makedirs(metrics_dir)
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        tok_eps = []
        for g in range(cfg.dp):  # dp = 1: the names and endpoints of a single group, as always
            sfx = f"-{g}" if cfg.dp > 1 else ""
            tok_ep, wrk_ep = f"ipc://{run_dir}/scheduler{sfx}.ipc", f"ipc://{run_dir}/worker{sfx}.ipc"
            tok_eps.append(tok_ep)
            self._spawn(f"scheduler{sfx}", "services.scheduler",
                        replace(cfg.scheduler, tokenizer_endpoint=tok_ep, worker_endpoint=wrk_ep,
                                metrics_port=sched_metrics[g],
                                kv_events_endpoint=group_endpoint(cfg.scheduler.kv_events_endpoint, g)))
            wcfg = replace(cfg.worker, scheduler_endpoint=wrk_ep)
            if g and wcfg.tp_size > 1:  # each group's ranks meet on their own port
                wcfg = replace(wcfg, dist_init_addr=f"{wcfg.dist_init_addr.rsplit(':', 1)[0]}:{free_port()}")
            for rank in range(wcfg.tp_size):  # one process per tensor-parallel rank; rank 0 talks to the scheduler
                self._spawn(f"worker{sfx}-{rank}", "services.worker",
                            replace(wcfg, tp_rank=rank, metrics_port=worker_metrics[g] if rank == 0 else 0), gpus[g])
        port_files = []
        for i in range(cfg.num_tokenizers):
            pf = os.path.join(run_dir, f"tokenizer-{i}.port")
            port_files.append(pf)
            tcfg = replace(cfg.tokenizer, scheduler_endpoint=",".join(tok_eps), grpc_port=port, http_port=http_port,
                           smg_grpc_port=smg_port, port_file=pf,
                           replica_id=cfg.tokenizer.replica_id or f"tokenizer-{i}-{os.getpid()}")
            self._spawn(f"tokenizer-{i}", "services.tokenizer", tcfg, {MULTIPROC_ENV: metrics_dir})
        deadline = time.monotonic() + cfg.startup_timeout
        ready = False
        while not self.stopping:
            dead = [(n, p) for n, p in self.procs if p.poll() is not None]
            if dead:
                name, p = dead[0]
                if ready and name.startswith("worker") and self._restart_group(name, p):
                    continue
                how = how_it_ended(p.returncode)
                log.error("process_exited", process=name, pid=p.pid, returncode=p.returncode, how=how)
                print(f"Banyan is stopping: {name} (pid {p.pid}) exited, {how}", file=sys.stderr, flush=True)
                self.shutdown()
                return 1
            if not ready and all(os.path.exists(pf) for pf in port_files):
                ready = True
                log.info("serving", grpc_port=port, http_port=http_port, tokenizers=cfg.num_tokenizers, dp=cfg.dp,
                         smg_grpc_port=-1 if cfg.tokenizer.disable_smg_grpc else (smg_port if smg_port > 0 else port))
                one = cfg.dp == 1  # a port, or a list of one per group
                log.info("metrics_ports", tokenizer=http_port, scheduler=sched_metrics[0] if one else sched_metrics,
                         worker=worker_metrics[0] if one else worker_metrics)
                http = f", OpenAI-compatible HTTP on port {http_port}" if http_port > 0 else ""
                print(f"Banyan is serving gRPC on port {port}{http}", file=sys.stderr, flush=True)
                if cfg.ready_file:  # lines: gRPC port, HTTP port (-1: none), scheduler and worker metrics
                    lines = [port, http_port, sched_metrics[0], worker_metrics[0]]  # ports (0: none) of group 0
                    if not one:  # then every group's, comma-separated
                        lines += [",".join(map(str, sched_metrics)), ",".join(map(str, worker_metrics))]
                    with open(cfg.ready_file + ".tmp", "w") as f:  # never seen half-written
                        f.write("".join(f"{x}\n" for x in lines))
                    os.replace(cfg.ready_file + ".tmp", cfg.ready_file)
            if not ready and time.monotonic() > deadline:
                log.error("startup_timeout", seconds=cfg.startup_timeout)
                self.shutdown()
                return 1
            time.sleep(0.1)
        return 0 if self.shutdown() else 1

    def _restart_group(self, name: str, dead: subprocess.Popen) -> bool:
        """Worker rank ``name`` exited: kill its group's other ranks (useless alone, maybe stuck in
        a collective) and start the whole group again; False when no restart is left."""
        group = worker_group(name)
        ranks = [(n, p) for n, p in self.procs if n.startswith("worker") and worker_group(n) == group]
        for _, p in ranks:
            if p.poll() is None:
                p.kill()
        for _, p in ranks:
            p.wait()
        how, limit = how_it_ended(dead.returncode), self.cfg.max_worker_restarts
        if not self.restarts.take():
            log.error("worker_restarts_exhausted", process=name, pid=dead.pid, returncode=dead.returncode, how=how,
                      max_worker_restarts=limit, window_s=self.cfg.worker_restart_window)
            return False
        log.error("worker_exited", process=name, pid=dead.pid, returncode=dead.returncode, how=how,
                  restart=self.restarts.used, max_worker_restarts=limit, ranks=[n for n, _ in ranks])
        self.procs = [(n, p) for n, p in self.procs if all(p is not q for _, q in ranks)]
        port = free_port()
        for n, _ in ranks:
            module, cfg, env = self.spawned[n]
            if isinstance(cfg, WorkerConfig) and cfg.tp_size > 1:  # the ranks meet on a fresh port
                cfg = replace(cfg, dist_init_addr=f"{cfg.dist_init_addr.rsplit(':', 1)[0]}:{port}")
            self._spawn(n, module, cfg, env)
        return True

    def _on_signal(self, signum, _frame) -> None:
        self.stopping = True

    def shutdown(self) -> bool:
        """Tokenizers first (they drain their streams), then the scheduler, then the worker. Each
        exit is logged (``exited``, with its returncode); True when every process exited 0."""
        clean = True
        for group in (("tokenizer",), ("scheduler",), ("worker",)):
            procs = [(n, p) for n, p in self.procs if n.startswith(group)]
            for _, p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            for name, p in procs:
                try:
                    p.wait(timeout=self.cfg.tokenizer.grace_seconds + 5)
                except subprocess.TimeoutExpired:
                    log.warning("killing", pid=p.pid)
                    p.kill()
                    p.wait()
                (log.info if p.returncode == 0 else log.error)("exited", process=name, pid=p.pid,
                                                               returncode=p.returncode)
                clean = clean and p.returncode == 0
        self.ports.release()
        log.info("stopped", clean=clean)
        return clean
