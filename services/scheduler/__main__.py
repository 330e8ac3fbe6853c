"""``python -m services.scheduler`` — run the scheduler alone (flags or BANYAN_* env vars)."""

from __future__ import annotations

from shared.config import SchedulerConfig, add_arguments, from_namespace
from shared.entry import Parser, configured, end_process, tie_to_launcher
from shared.logging import setup_logging


def main(argv: list[str] | None = None) -> None:
    tie_to_launcher()  # first: started by `banyan serve`, it dies with it
    ap = Parser(prog="banyan scheduler", description="Banyan scheduler service")
    add_arguments(ap, SchedulerConfig)
    ns = ap.parse_args(argv)
    cfg = configured(ap.prog, ns.debug, lambda: from_namespace(SchedulerConfig, ns), SchedulerConfig)
    setup_logging("scheduler", cfg.log_level, cfg.log_format)
    from shared.model_path import resolve_model

    configured(ap.prog, ns.debug, lambda: resolve_model(cfg.model))  # a bad model: one line, before the heavy imports
    from services.scheduler.scheduler import Scheduler

    Scheduler(cfg).run()
    end_process(0)  # (no interpreter teardown: see end_process)


if __name__ == "__main__":
    main()
