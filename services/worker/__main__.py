"""``python -m services.worker`` — run worker rank 0 alone (flags or BANYAN_* env vars)."""

from __future__ import annotations

from shared.config import WorkerConfig, add_arguments, from_namespace
from shared.entry import Parser, configured, end_process, tie_to_launcher
from shared.logging import setup_logging


def main(argv: list[str] | None = None) -> None:
    tie_to_launcher()  # first: started by `banyan serve`, it dies with it
    ap = Parser(prog="banyan worker", description="Banyan worker service")
    add_arguments(ap, WorkerConfig)
    ns = ap.parse_args(argv)
    cfg = configured(ap.prog, ns.debug, lambda: from_namespace(WorkerConfig, ns), WorkerConfig)
    setup_logging("worker", cfg.log_level, cfg.log_format)
    from shared import knobs

    configured(ap.prog, ns.debug, knobs.load)  # (every BANYAN_* knob parsed and checked once, here)
    from shared.model_path import resolve_model

    model_dir, name = configured(ap.prog, ns.debug, lambda: resolve_model(cfg.model))  # before the heavy imports
    from services.worker.server import serve

    try:
        serve(cfg, model_dir, (cfg.served_model_names or [name])[0])
    except SystemExit as e:  # (orphaned: exits 1 for its supervisor, as quietly)
        end_process(e.code if isinstance(e.code, int) else 1)
    end_process(0)  # (no interpreter teardown: see end_process)


if __name__ == "__main__":
    main()
