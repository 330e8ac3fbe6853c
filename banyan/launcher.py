"""``banyan serve``: start the scheduler, the worker ranks and N tokenizer replicas on one host
(``--dp N``: N scheduler + worker groups, every tokenizer connected to all of them), supervise
them, and stop them in order (tokenizers drain first) on SIGINT/SIGTERM/SIGHUP.

Before any process starts: run directories of launchers that died are swept away, and every fixed
port is checked and held (``ports.py``). Every service dies with the launcher (the parent-death
signal, ``shared/entry.py``). Once serving, a process that exits is restarted (``supervision.py``):
a scheduler with its whole group, a worker rank with its group's ranks, a tokenizer replica on
the same shared ports; a process that exits before the server first serves, or a unit out of
restarts, stops everything with exit code 1 and one line naming it. The run directory is removed
on every exit the launcher lives to make."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, replace

from shared.config import SchedulerConfig, TokenizerConfig, WorkerConfig, to_argv
from shared.entry import LAUNCHER_ENV
from shared.logging import get_logger
from banyan import rundir
from banyan.ports import FixedPort, PortBusy, PortReservations, free_port
from banyan.supervision import RestartCounter, RestartPolicy, how_it_ended, kind_of, worker_group

__all__ = ["Launcher", "PortReservations", "ServeConfig", "free_port"]
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
    max_restarts: int = 3  # restarts of each unit (a group, a replica) within restart_window
    restart_window: float = 600.0  # seconds


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    started: float


def _metrics_port(port: int, reserve: PortReservations, group: int = 0) -> int:
    """A service's ``metrics_port`` (0 = off) from a launcher setting (0 = a free port, -1 = off;
    a fixed port is group 0's, group g gets port + g)."""
    if port == 0:
        return reserve.take()
    return port + group if port > 0 else 0


def fixed_ports(cfg: ServeConfig) -> list[FixedPort]:
    """The ports the user fixed (checked and held before anything starts)."""
    given = ((cfg.tokenizer.grpc_port, "--grpc-port"), (cfg.tokenizer.http_port, "--http-port"))
    out = [FixedPort(p, f) for p, f in given if p > 0]
    for port, flag in ((cfg.scheduler_metrics_port, "--scheduler-metrics-port"),
                       (cfg.worker_metrics_port, "--worker-metrics-port")):
        out += [FixedPort(port + g, flag) for g in range(cfg.dp) if port > 0]
    return out


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


def _secrets_to_env(argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """Move ``--api-key`` from a child's argv (visible to every local user in ``ps``) into its
    environment (``BANYAN_API_KEY``)."""
    env = dict(os.environ)
    if "--api-key" in argv:
        i = argv.index("--api-key")
        env["BANYAN_API_KEY"] = argv[i + 1]
        argv = argv[:i] + argv[i + 2:]
    return argv, env


def exposure_warning(host: str, api_key: str) -> str:
    """The line said after ``Banyan is serving …`` when anyone who reaches this host can use it ("" else)."""
    if host not in ("0.0.0.0", "::", "") or api_key:
        return ""
    return ("It listens on every interface and asks no API key: whoever reaches this host can use it "
            "(--host 127.0.0.1: this machine only; --api-key KEY: a key required)")


def say(line: str) -> None:
    """A line for the operator on stderr, whatever the log level."""
    print(line, file=sys.stderr, flush=True)


class Launcher:
    def __init__(self, cfg: ServeConfig) -> None:
        self.cfg = cfg
        self.children: dict[str, Child] = {}  # the processes running now, by name (a group's scheduler first)
        self.spawned: dict[str, tuple[str, object, dict[str, str] | None]] = {}  # name → how to start it again
        self.policy = RestartPolicy(cfg.max_restarts, cfg.restart_window)
        self.pending: dict[str, tuple[float, list[str]]] = {}  # restart unit → (when, the names to start)
        self.port_files: dict[str, str] = {}  # tokenizer → its port file (written once it serves)
        self.returning: dict[str, float] = {}  # restarted tokenizers not serving yet → when they exited
        self.ports = PortReservations()
        self.run_dir: rundir.RunDir | None = None
        self.counter: RestartCounter | None = None
        self.ready = False
        self.signals = 0  # SIGINT/SIGTERM/SIGHUP received: the first stops in order …
        self.at_once = False  # … and a Ctrl-C (SIGINT) after it stops at once (a repeated SIGTERM does not)

    def _spawn(self, name: str, module: str, cfg, extra_env: dict[str, str] | None = None) -> None:
        argv, env = _secrets_to_env(to_argv(cfg))
        for var in (MULTIPROC_ENV, MULTIPROC_ENV.lower()):  # only the tokenizers share a metrics directory
            env.pop(var, None)
        env.update(extra_env or {})
        env[LAUNCHER_ENV] = str(os.getpid())  # the service dies with this process (shared/entry.py)
        p = subprocess.Popen([sys.executable, "-m", module, *argv], start_new_session=True, env=env)
        self.children[name] = Child(name, p, time.monotonic())
        self.spawned[name] = (module, cfg, extra_env)
        log.info("started", process=name, pid=p.pid)

    def run(self) -> int:
        cfg = self.cfg
        for path in rundir.sweep():
            log.info("run_dir_swept", path=path, why="its launcher is gone")
        fixed = fixed_ports(cfg)
        try:
            self.ports.hold_fixed(fixed)
            gpus = _group_gpus(cfg.worker, cfg.dp)
        except (PortBusy, RuntimeError) as e:
            self.ports.release()
            say(f"banyan serve: error: {e}")
            return 1
        self.run_dir = rundir.RunDir([p.port for p in fixed])
        self._remove_ready_file()  # one a killed server left names ports nobody serves
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self._on_signal)
        try:
            return self._serve(gpus)
        finally:
            if self.children:
                self.shutdown()
            if self.counter is not None:
                self.counter.close()
            self.run_dir.remove()
            self._remove_ready_file()  # the file goes with the server (`banyan top --ready-file` waits for the next)
            self.ports.release()

    def _remove_ready_file(self) -> None:
        for path in (self.cfg.ready_file, self.cfg.ready_file + ".tmp") if self.cfg.ready_file else ():
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    def _serve(self, gpus: list[dict[str, str]]) -> int:
        cfg, run_dir, reserve = self.cfg, self.run_dir, self.ports  # (held for the launcher's life: restarts rebind)
        port = cfg.tokenizer.grpc_port or reserve.take()
        http_port = cfg.tokenizer.http_port or reserve.take()  # -1 (no HTTP) stays
        self.smg_port = cfg.tokenizer.smg_grpc_port or reserve.take()  # -1 (SMG's service on the gRPC port) stays
        sched_metrics = [_metrics_port(cfg.scheduler_metrics_port, reserve, g) for g in range(cfg.dp)]
        worker_metrics = [_metrics_port(cfg.worker_metrics_port, reserve, g) for g in range(cfg.dp)]
        # tokenizer replicas write their metrics here; a scrape of any of them sums all (multiprocess mode)
        metrics_dir = run_dir.join("tokenizer-metrics")
        os.makedirs(metrics_dir)
        tok_eps = []
        for g in range(cfg.dp):  # dp = 1: the names and endpoints of a single group, as always
            sfx = f"-{g}" if cfg.dp > 1 else ""
            tok_ep, wrk_ep = f"ipc://{run_dir.join(f'scheduler{sfx}.ipc')}", f"ipc://{run_dir.join(f'worker{sfx}.ipc')}"
            tok_eps.append(tok_ep)
            self._spawn(f"scheduler{sfx}", "services.scheduler",
                        replace(cfg.scheduler, tokenizer_endpoint=tok_ep, worker_endpoint=wrk_ep,
                                metrics_port=sched_metrics[g],
                                kv_events_endpoint=group_endpoint(cfg.scheduler.kv_events_endpoint, g)))
            wcfg = replace(cfg.worker, scheduler_endpoint=wrk_ep)
            if sfx and wcfg.hicache_storage_dir:  # each group's KV files apart (the groups' trees differ)
                wcfg = replace(wcfg, hicache_storage_dir=os.path.join(wcfg.hicache_storage_dir, f"group{sfx}"))
            if g and wcfg.tp_size > 1:  # each group's ranks meet on their own port
                wcfg = replace(wcfg, dist_init_addr=f"{wcfg.dist_init_addr.rsplit(':', 1)[0]}:{free_port()}")
            for rank in range(wcfg.tp_size):  # one process per tensor-parallel rank; rank 0 talks to the scheduler
                self._spawn(f"worker{sfx}-{rank}", "services.worker",
                            replace(wcfg, tp_rank=rank, metrics_port=worker_metrics[g] if rank == 0 else 0), gpus[g])
        for i in range(cfg.num_tokenizers):
            pf = self.port_files[f"tokenizer-{i}"] = run_dir.join(f"tokenizer-{i}.port")
            tcfg = replace(cfg.tokenizer, scheduler_endpoint=",".join(tok_eps), grpc_port=port, http_port=http_port,
                           smg_grpc_port=self.smg_port, port_file=pf,
                           replica_id=cfg.tokenizer.replica_id or f"tokenizer-{i}-{os.getpid()}")
            self._spawn(f"tokenizer-{i}", "services.tokenizer", tcfg, {MULTIPROC_ENV: metrics_dir})
        self.counter = RestartCounter(metrics_dir, list(self.children))
        deadline = time.monotonic() + cfg.startup_timeout
        while not self.signals:
            self._start_due()
            for name, child in list(self.children.items()):
                if self.children.get(name) is child and child.proc.poll() is not None and not self._exited(child):
                    self.shutdown()
                    return 1
            self._note_returns()
            if not self.ready and all(os.path.exists(pf) for pf in self.port_files.values()):
                self.ready = True
                self._announce(port, http_port, sched_metrics, worker_metrics)
            if not self.ready and time.monotonic() > deadline:
                log.error("startup_timeout", seconds=cfg.startup_timeout)
                say(f"Banyan is stopping: still not serving {cfg.startup_timeout:.0f} s after the start")
                self.shutdown()
                return 1
            time.sleep(0.1)
        return 0 if self.shutdown() else 1

    def _announce(self, port: int, http_port: int, sched_metrics: list[int], worker_metrics: list[int]) -> None:
        cfg, one = self.cfg, self.cfg.dp == 1  # a port, or a list of one per group
        log.info("serving", grpc_port=port, http_port=http_port, tokenizers=cfg.num_tokenizers, dp=cfg.dp,
                 smg_grpc_port=-1 if cfg.tokenizer.disable_smg_grpc else self.smg_port if self.smg_port > 0 else port)
        log.info("metrics_ports", tokenizer=http_port, scheduler=sched_metrics[0] if one else sched_metrics,
                 worker=worker_metrics[0] if one else worker_metrics)
        http = f", OpenAI-compatible HTTP on port {http_port}" if http_port > 0 else ""
        say(f"Banyan is serving gRPC on port {port}{http}")
        warning = exposure_warning(cfg.tokenizer.host, cfg.tokenizer.api_key)
        if warning:
            say(warning)

        def ports(ps: list[int]) -> str:
            return ",".join(str(p) for p in ps) if any(ps) else "off"

        tok = f"tokenizers on the HTTP port {http_port}" if http_port > 0 else "tokenizers off (no HTTP)"
        say(f"Metrics (Prometheus /metrics): {tok}, scheduler on port {ports(sched_metrics)}, "
            f"worker on port {ports(worker_metrics)}")
        if cfg.ready_file:  # lines: gRPC port, HTTP port (-1: none), scheduler and worker metrics
            lines = [port, http_port, sched_metrics[0], worker_metrics[0]]  # ports (0: none) of group 0
            if not one:  # then every group's, comma-separated
                lines += [",".join(map(str, sched_metrics)), ",".join(map(str, worker_metrics))]
            with open(cfg.ready_file + ".tmp", "w") as f:  # never seen half-written
                f.write("".join(f"{x}\n" for x in lines))
            os.replace(cfg.ready_file + ".tmp", cfg.ready_file)

    # ---- a process exited ---------------------------------------------------------------------
    def _unit(self, name: str) -> tuple[str, list[str]]:
        """What is restarted together when ``name`` exits: (unit, its processes, in start order)."""
        if name.startswith("scheduler"):
            sfx = name[len("scheduler"):]
            workers = [n for n in self.spawned if n.startswith("worker") and worker_group(n) == f"worker{sfx}"]
            return name, [name, *workers]
        if name.startswith("worker"):
            group = worker_group(name)
            return group, [n for n in self.spawned if n.startswith("worker") and worker_group(n) == group]
        return name, [name]

    def _exited(self, dead: Child) -> bool:
        """``dead`` exited: schedule its unit's restart (True), or say why everything stops (False)."""
        name, p = dead.name, dead.proc
        ran, how, kind = time.monotonic() - dead.started, how_it_ended(p.returncode), kind_of(name)
        unit, members = self._unit(name)
        verdict = self.policy.exited(unit, ran) if self.ready else None
        if verdict is None or not verdict.restart:
            why = verdict.reason if verdict else "before the server was ready"
            log.error(f"{kind}_restarts_exhausted" if verdict else "process_exited", process=name, pid=p.pid,
                      returncode=p.returncode, how=how, ran_s=round(ran, 1), reason=why)
            if verdict:  # (the line every exit that stops the server has)
                log.error("process_exited", process=name, pid=p.pid, returncode=p.returncode, how=how)
            say(f"Banyan is stopping: {name} (pid {p.pid}) exited, {how}, {ran:.1f} s after its start; {why}")
            return False
        others = [self.children[n] for n in members if n in self.children and n != name]
        for c in others:  # alone they are useless (a worker rank may be stuck in a collective)
            if c.proc.poll() is None:
                c.proc.kill()
        for c in [dead, *others]:
            c.proc.wait()
            del self.children[c.name]
            if c.name in self.port_files:  # a replica: its gauges of requests in flight go, it serves again later
                self._replica_gone(c)
        self.counter.inc(name)
        log.error(f"{kind}_exited", process=name, pid=p.pid, returncode=p.returncode, how=how, ran_s=round(ran, 1),
                  restart=self.policy.used(unit), max_restarts=self.cfg.max_restarts, delay_s=verdict.delay_s,
                  restarting=members)
        for u, (_, names) in list(self.pending.items()):  # (a worker restart waiting, its scheduler now dead)
            if set(names) & set(members):
                del self.pending[u]
        self.pending[unit] = (time.monotonic() + verdict.delay_s, members)
        return True

    def _replica_gone(self, c: Child) -> None:
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(c.proc.pid, self.run_dir.join("tokenizer-metrics"))
        try:
            os.unlink(self.port_files[c.name])
        except FileNotFoundError:
            pass
        self.returning[c.name] = time.monotonic()

    def _start_due(self) -> None:
        now = time.monotonic()
        for unit, (when, members) in list(self.pending.items()):
            if now < when:
                continue
            del self.pending[unit]
            port = free_port()
            for n in members:
                module, cfg, env = self.spawned[n]
                if isinstance(cfg, WorkerConfig) and cfg.tp_size > 1:  # the ranks meet on a fresh port
                    cfg = replace(cfg, dist_init_addr=f"{cfg.dist_init_addr.rsplit(':', 1)[0]}:{port}")
                self._spawn(n, module, cfg, env)
            log.warning("restarted", unit=unit, processes={n: self.children[n].proc.pid for n in members})

    def _note_returns(self) -> None:
        for name, since in list(self.returning.items()):
            if name in self.children and os.path.exists(self.port_files[name]):
                del self.returning[name]
                log.warning("tokenizer_serving_again", process=name, pid=self.children[name].proc.pid,
                            down_s=round(time.monotonic() - since, 2))

    # ---- stopping -----------------------------------------------------------------------------
    def _on_signal(self, signum, _frame) -> None:
        self.at_once = self.at_once or (self.signals > 0 and signum == signal.SIGINT)
        self.signals += 1

    def shutdown(self) -> bool:
        """Tokenizers first (they drain their streams), then the scheduler, then the worker; a
        second Ctrl-C kills what is left at once. Each exit is logged (``exited``, with its
        returncode); True when every process exited 0."""
        self.pending.clear()
        grace = self.cfg.tokenizer.grace_seconds
        if self.signals:
            say(f"Banyan is stopping: the tokenizers finish the requests in flight (up to {grace:.0f} s), then the "
                f"scheduler and the worker exit. Press Ctrl-C again to stop at once.")
        clean, told = True, False
        for kinds in (("tokenizer",), ("scheduler",), ("worker",)):
            group = [c for c in self.children.values() if c.name.startswith(kinds)]
            for c in group:
                if c.proc.poll() is None:
                    c.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + grace + 5
            while any(c.proc.poll() is None for c in group):
                if self.at_once or time.monotonic() > deadline:
                    if self.at_once and not told:
                        told = True
                        say("Banyan is stopping at once: the services are killed")
                    for c in group:
                        if c.proc.poll() is None:
                            log.warning("killing", process=c.name, pid=c.proc.pid)
                            c.proc.kill()
                    for c in group:
                        c.proc.wait()
                time.sleep(0.02)
            for c in group:
                (log.info if c.proc.returncode == 0 else log.error)("exited", process=c.name, pid=c.proc.pid,
                                                                    returncode=c.proc.returncode)
                clean = clean and c.proc.returncode == 0
        self.children.clear()
        log.info("stopped", clean=clean)
        return clean
