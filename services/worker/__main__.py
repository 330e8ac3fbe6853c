"""``python -m services.worker`` — run worker rank 0 alone (flags or BANYAN_* env vars)."""

from __future__ import annotations

import argparse

from shared.config import WorkerConfig, add_arguments, from_namespace
from shared.logging import setup_logging


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="banyan worker", description="Banyan worker service")
    add_arguments(ap, WorkerConfig)
    cfg = from_namespace(WorkerConfig, ap.parse_args(argv))
    setup_logging("worker", cfg.log_level, cfg.log_format)
    from shared.model_path import resolve_model
    from services.worker.server import serve

    model_dir, name = resolve_model(cfg.model)
    serve(cfg, model_dir, name)


if __name__ == "__main__":
    main()
