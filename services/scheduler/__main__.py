"""``python -m services.scheduler`` — run the scheduler alone (flags or BANYAN_* env vars)."""

from __future__ import annotations

import argparse

from shared.config import SchedulerConfig, add_arguments, from_namespace
from shared.logging import setup_logging


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="banyan scheduler", description="Banyan scheduler service")
    add_arguments(ap, SchedulerConfig)
    cfg = from_namespace(SchedulerConfig, ap.parse_args(argv))
    setup_logging("scheduler", cfg.log_level, cfg.log_format)
    from services.scheduler.scheduler import Scheduler

    Scheduler(cfg).run()


if __name__ == "__main__":
    main()
