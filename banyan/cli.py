"""The ``banyan`` command: ``serve`` (all services on one host) or one service alone."""

from __future__ import annotations

import argparse
import os
import sys

from shared.config import SchedulerConfig, TokenizerConfig, WorkerConfig, add_arguments, from_namespace
from shared.entry import Parser, configured
from shared.logging import setup_logging

_ENDPOINTS = ("scheduler_endpoint", "tokenizer_endpoint", "worker_endpoint", "port_file")
DEMO_NAME = "banyan-demo"  # the served name of the embedded demo model
SERVICES = {"tokenizer": "services.tokenizer.__main__", "scheduler": "services.scheduler.__main__",
            "worker": "services.worker.__main__"}


def resolve(model: str) -> tuple[str, str]:
    """(directory, default served name) of ``--model``: empty → the embedded demo model (built
    offline once); else a directory or a hub id in the local Hugging Face cache."""
    if not model:
        from banyan.demo import ensure_demo_model

        return ensure_demo_model(), DEMO_NAME
    from shared.model_path import resolve_model

    return resolve_model(model)


def _env_int(*names: str, default: int) -> int:
    return int(next((os.environ[n] for n in names if n in os.environ), default))


def serve(argv: list[str]) -> int:
    from banyan.launcher import Launcher, ServeConfig, fixed_ports, say
    from banyan.ports import PortBusy, check_free, free_port

    ap = Parser(prog="banyan serve", description="Serve a model: scheduler, worker and tokenizer replicas on this host")
    add_arguments(ap, TokenizerConfig, skip=_ENDPOINTS)
    common = ("model", "served_model_name", "log_level", "otlp_endpoint", "metrics_port")
    add_arguments(ap, SchedulerConfig, skip=_ENDPOINTS + common)
    add_arguments(ap, WorkerConfig, skip=_ENDPOINTS + common + ("tp_size", "tp_rank"))
    ap.add_argument("--tp", "--tp-size", dest="tp_size", type=int, default=int(os.environ.get("BANYAN_TP_SIZE", 1)),
                    help="tensor-parallel ranks: one worker process each [env BANYAN_TP_SIZE, default 1]")
    ap.add_argument("--dp", "--dp-size", dest="dp_size", type=int, default=int(os.environ.get("BANYAN_DP_SIZE", 1)),
                    help="data-parallel groups: each a scheduler + --tp worker ranks with its own KV pool; the "
                         "tokenizers route each request by prefix affinity and load [env BANYAN_DP_SIZE, default 1]")
    ap.add_argument("--num-tokenizers", type=int, default=_env_int("BANYAN_NUM_TOKENIZERS", default=1),
                    help="tokenizer replicas sharing the gRPC and HTTP ports [env BANYAN_NUM_TOKENIZERS, default 1]")
    ap.add_argument("--ready-file", default=os.environ.get("BANYAN_READY_FILE", ""),
                    help="once serving, write the gRPC port here (then one a line: the HTTP port or -1, the "
                         "scheduler's and the worker's metrics ports or 0; with --dp > 1 those of group 0, then "
                         "the schedulers' and the workers' of every group, comma-separated) [env BANYAN_READY_FILE]")
    for service in ("scheduler", "worker"):
        env = f"BANYAN_{service.upper()}_METRICS_PORT"
        ap.add_argument(f"--{service}-metrics-port", type=int, default=int(os.environ.get(env, 0)),
                        help=f"Prometheus /metrics port of the {service} (0 = a free port, printed; -1 = none; "
                             f"with --dp, group g gets this port + g) [env {env}, default 0]")
    ap.add_argument("--max-restarts", "--max-worker-restarts", dest="max_restarts", type=int,
                    default=_env_int("BANYAN_MAX_RESTARTS", "BANYAN_MAX_WORKER_RESTARTS", default=3),
                    help="once serving, a process that exits is restarted — a scheduler with its group's worker "
                         "ranks, a worker rank with its group's ranks, a tokenizer replica — each at most this many "
                         "times within --restart-window (after 1, 2, 4 … 8 s when it keeps dying young); then "
                         "everything stops with exit code 1 (0: never restart) [env BANYAN_MAX_RESTARTS, default 3]")
    ap.add_argument("--restart-window", "--worker-restart-window", dest="restart_window", type=float,
                    default=float(os.environ.get("BANYAN_RESTART_WINDOW",
                                                 os.environ.get("BANYAN_WORKER_RESTART_WINDOW", 600))),
                    help="seconds over which --max-restarts counts [env BANYAN_RESTART_WINDOW, default 600]")
    ns = ap.parse_args(argv)
    if ns.max_restarts < 0 or ns.restart_window <= 0:
        ap.error("--max-restarts must be >= 0 and --restart-window > 0")
    if ns.num_tokenizers < 1:
        ap.error("--num-tokenizers must be >= 1")
    if ns.dp_size < 1:
        ap.error("--dp must be >= 1")
    if ns.tp_size > 1 and not ns.dist_init_addr:  # the ranks meet on a free local port
        ns.dist_init_addr = f"127.0.0.1:{free_port()}"

    def build(**model) -> ServeConfig:
        return ServeConfig(tokenizer=from_namespace(TokenizerConfig, ns, **model),
                           scheduler=from_namespace(SchedulerConfig, ns, **model),
                           worker=from_namespace(WorkerConfig, ns, **model), num_tokenizers=ns.num_tokenizers,
                           ready_file=ns.ready_file, scheduler_metrics_port=ns.scheduler_metrics_port,
                           worker_metrics_port=ns.worker_metrics_port, dp=ns.dp_size,
                           max_restarts=ns.max_restarts, restart_window=ns.restart_window)

    classes = (TokenizerConfig, SchedulerConfig, WorkerConfig)
    cfg = configured(ap.prog, ns.debug, build, *classes)
    try:  # fast, before the model is looked at (the launcher checks and holds them again)
        check_free(fixed_ports(cfg))
    except PortBusy as e:
        say(f"{ap.prog}: error: {e}")
        return 1
    if ns.model.endswith(".gguf"):  # a bad file: one line, exit 1, nothing started
        from banyan.convert import resolve_gguf

        if (found := resolve_gguf(ap.prog, ns.model, ns.dtype)) is None:
            return 1
        model_dir, name = found
    else:
        model_dir, name = configured(ap.prog, ns.debug, lambda: resolve(ns.model))
    cfg = configured(ap.prog, ns.debug, lambda: build(model=model_dir, served_model_name=ns.served_model_name or name),
                     *classes)
    setup_logging("launcher", ns.log_level, ns.log_format)
    return Launcher(cfg).run()


# subcommand → (one line for `banyan --help`, how it runs)
COMMANDS: dict[str, str] = {
    "serve": "serve a model on this host: scheduler, worker ranks and tokenizer replicas",
    "convert": "write a GGUF file (llama.cpp's format) out as an HF model directory",
    "tokenizer": "run one tokenizer replica alone (gRPC + OpenAI-compatible HTTP; for compose / Kubernetes)",
    "scheduler": "run one scheduler alone (batching, prefix cache, KV bookkeeping)",
    "worker": "run one worker rank alone (weights, KV cache, attention, sampling)",
    "bench": "benchmark a running server (Banyan gRPC or any OpenAI-compatible HTTP server)",
    "check-env": "check this host can serve: Python, torch, CUDA, FlashInfer, xgrammar, gRPC, model, ports, /dev/shm",
    "top": "live view of a running deployment (load, tokens/s, cache, KV, latency) from its metrics",
}


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("banyan")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"usage: banyan COMMAND [flags]   (banyan COMMAND --help for its flags; every flag is also a BANYAN_* "
             "environment variable)", "", "Banyan LLM serving engine. Commands:"]
    lines += [f"  {name:<{width}}  {text}" for name, text in COMMANDS.items()]
    lines += ["", "  -h, --help   this text", "  --version    the installed version"]
    return "\n".join(lines)


def run_service(cmd: str, argv: list[str]) -> None:
    """``banyan tokenizer|scheduler|worker``: the service alone, given the demo model's directory
    (and name) when ``--model`` (or ``BANYAN_MODEL``) is empty."""
    import importlib

    if not {"-h", "--help"} & set(argv):
        pre = argparse.ArgumentParser(add_help=False)
        pre.add_argument("--model", default=os.environ.get("BANYAN_MODEL", ""))
        pre.add_argument("--served-model-name", action="append", default=[])
        known, _ = pre.parse_known_args(argv)
        if not known.model:
            model_dir, name = resolve("")
            named = known.served_model_name or os.environ.get("BANYAN_SERVED_MODEL_NAME")
            argv = [*argv, "--model", model_dir, *([] if named else ["--served-model-name", name])]
    importlib.import_module(SERVICES[cmd]).main(argv)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help", "help"):
        print(usage())
        sys.exit(0)
    if argv and argv[0] in ("-V", "--version"):
        print(f"banyan {version()}")
        sys.exit(0)
    if not argv:
        print(usage(), file=sys.stderr)
        sys.exit(2)
    if argv[0] not in COMMANDS:
        print(f"banyan: error: unknown command {argv[0]!r} (banyan --help lists the commands: "
              f"{', '.join(COMMANDS)})", file=sys.stderr)
        sys.exit(2)
    cmd, rest = argv[0], argv[1:]
    if cmd in ("bench", "check-env", "top", "convert"):  # a server out of reach, a file missing: one line (exit 1)
        import importlib

        from banyan.errors import run_command

        module = {"bench": "banyan.bench.cli", "check-env": "banyan.tools.check_env", "top": "banyan.tools.top",
                  "convert": "banyan.convert"}[cmd]
        sys.exit(run_command(f"banyan {cmd}", importlib.import_module(module).main, rest))
    if cmd == "serve":
        sys.exit(serve(rest))
    run_service(cmd, rest)


if __name__ == "__main__":
    main()
