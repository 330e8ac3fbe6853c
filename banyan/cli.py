"""The ``banyan`` command: ``serve`` (all services on one host) or one service alone."""

from __future__ import annotations

import argparse
import sys

from shared.config import (SchedulerConfig, TokenizerConfig, WorkerConfig, add_arguments, from_namespace)
from shared.logging import setup_logging

_ENDPOINTS = ("scheduler_endpoint", "tokenizer_endpoint", "worker_endpoint", "port_file")


def serve(argv: list[str]) -> int:
    from banyan.launcher import Launcher, ServeConfig

    ap = argparse.ArgumentParser(prog="banyan serve",
                                 description="Serve a model: scheduler, worker and tokenizer replicas on this host")
    add_arguments(ap, TokenizerConfig, skip=_ENDPOINTS)
    add_arguments(ap, SchedulerConfig, skip=_ENDPOINTS + ("model", "log_level"))
    add_arguments(ap, WorkerConfig, skip=_ENDPOINTS + ("model", "log_level"))
    ap.add_argument("--num-tokenizers", type=int, default=1, help="tokenizer replicas sharing the gRPC port")
    ap.add_argument("--ready-file", default="", help="write the gRPC port here once serving")
    ns = ap.parse_args(argv)
    if ns.num_tokenizers < 1:
        ap.error("--num-tokenizers must be >= 1")
    setup_logging("launcher", ns.log_level)
    cfg = ServeConfig(tokenizer=from_namespace(TokenizerConfig, ns), scheduler=from_namespace(SchedulerConfig, ns),
                      worker=from_namespace(WorkerConfig, ns), num_tokenizers=ns.num_tokenizers,
                      ready_file=ns.ready_file)
    return Launcher(cfg).run()


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    commands = ("serve", "tokenizer", "scheduler", "worker")
    if not argv or argv[0] not in commands:
        print(f"usage: banyan {{{','.join(commands)}}} [flags]   (banyan COMMAND --help)", file=sys.stderr)
        sys.exit(2)
    cmd, rest = argv[0], argv[1:]
    if cmd == "serve":
        sys.exit(serve(rest))
    module = {"tokenizer": "services.tokenizer.__main__", "scheduler": "services.scheduler.__main__",
              "worker": "services.worker.__main__"}[cmd]
    import importlib

    importlib.import_module(module).main(rest)


if __name__ == "__main__":
    main()
