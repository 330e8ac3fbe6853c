"""``banyan serve``: start the scheduler, the worker ranks and N tokenizer replicas on one host,
supervise them, and stop them in order (tokenizers drain first) on SIGINT/SIGTERM."""

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


def _metrics_port(port: int) -> int:
    """A service's ``metrics_port`` (0 = off) from a launcher setting (0 = a free port, -1 = off)."""
    return free_port() if port == 0 else max(port, 0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
        self.stopping = False

    def _spawn(self, name: str, module: str, cfg, extra_env: dict[str, str] | None = None) -> None:
        argv, env = _secrets_to_env(to_argv(cfg))
        for var in (MULTIPROC_ENV, MULTIPROC_ENV.lower()):  # only the tokenizers share a metrics directory
            env.pop(var, None)
        env.update(extra_env or {})
        p = subprocess.Popen([sys.executable, "-m", module, *argv], start_new_session=True, env=env)
        self.procs.append((name, p))
        log.info("started", process=name, pid=p.pid)

    def run(self) -> int:
        cfg = self.cfg
        resolve_model(cfg.worker.model)  # builds the demo model once, before the services start
        run_dir = tempfile.mkdtemp(prefix="banyan-")
        tok_ep, wrk_ep = f"ipc://{run_dir}/scheduler.ipc", f"ipc://{run_dir}/worker.ipc"
        port = cfg.tokenizer.grpc_port or free_port()
        http_port = cfg.tokenizer.http_port or free_port()  # -1 (no HTTP) stays
        sched_metrics = _metrics_port(cfg.scheduler_metrics_port)
        worker_metrics = _metrics_port(cfg.worker_metrics_port)
        # tokenizer replicas write their metrics here; a scrape of any of them sums all (multiprocess mode)
        metrics_dir = os.path.join(run_dir, "tokenizer-metrics")
        os.makedirs(metrics_dir)
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        self._spawn("scheduler", "services.scheduler", replace(cfg.scheduler, tokenizer_endpoint=tok_ep,
                                                               worker_endpoint=wrk_ep, metrics_port=sched_metrics))
        wcfg = replace(cfg.worker, scheduler_endpoint=wrk_ep)
        for rank in range(wcfg.tp_size):  # one process per tensor-parallel rank; rank 0 talks to the scheduler
            self._spawn(f"worker-{rank}", "services.worker",
                        replace(wcfg, tp_rank=rank, metrics_port=worker_metrics if rank == 0 else 0))
        port_files = []
        for i in range(cfg.num_tokenizers):
            pf = os.path.join(run_dir, f"tokenizer-{i}.port")
            port_files.append(pf)
            tcfg = replace(cfg.tokenizer, scheduler_endpoint=tok_ep, grpc_port=port, http_port=http_port,
                           port_file=pf, replica_id=cfg.tokenizer.replica_id or f"tokenizer-{i}-{os.getpid()}")
            self._spawn(f"tokenizer-{i}", "services.tokenizer", tcfg, {MULTIPROC_ENV: metrics_dir})
        deadline = time.monotonic() + cfg.startup_timeout
        ready = False
        while not self.stopping:
            dead = [(n, p.returncode) for n, p in self.procs if p.poll() is not None]
            if dead:
                log.error("process_exited", process=dead[0][0], returncode=dead[0][1])
                self.shutdown()
                return 1
            if not ready and all(os.path.exists(pf) for pf in port_files):
                ready = True
                log.info("serving", grpc_port=port, http_port=http_port, tokenizers=cfg.num_tokenizers)
                log.info("metrics_ports", tokenizer=http_port, scheduler=sched_metrics, worker=worker_metrics)
                http = f", OpenAI-compatible HTTP on port {http_port}" if http_port > 0 else ""
                print(f"Banyan is serving gRPC on port {port}{http}", file=sys.stderr, flush=True)
                if cfg.ready_file:  # lines: gRPC port, HTTP port (-1: none), scheduler and worker metrics
                    with open(cfg.ready_file + ".tmp", "w") as f:  # ports (0: none); never seen half-written
                        f.write(f"{port}\n{http_port}\n{sched_metrics}\n{worker_metrics}\n")
                    os.replace(cfg.ready_file + ".tmp", cfg.ready_file)
            if not ready and time.monotonic() > deadline:
                log.error("startup_timeout", seconds=cfg.startup_timeout)
                self.shutdown()
                return 1
            time.sleep(0.1)
        self.shutdown()
        return 0

    def _on_signal(self, signum, _frame) -> None:
        self.stopping = True

    def shutdown(self) -> None:
        """Tokenizers first (they drain their streams), then the scheduler, then the worker."""
        for group in (("tokenizer",), ("scheduler",), ("worker",)):
            procs = [p for n, p in self.procs if n.startswith(group)]
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            for p in procs:
                try:
                    p.wait(timeout=self.cfg.tokenizer.grace_seconds + 5)
                except subprocess.TimeoutExpired:
                    log.warning("killing", pid=p.pid)
                    p.kill()
                    p.wait()
        log.info("stopped")
