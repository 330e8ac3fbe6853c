"""``python -m services.tokenizer`` — run one tokenizer replica (flags or BANYAN_* env vars)."""

from __future__ import annotations

from shared.config import TokenizerConfig, add_arguments, from_namespace
from shared.entry import Parser, configured, end_process, tie_to_launcher
from shared.logging import setup_logging


def main(argv: list[str] | None = None) -> None:
    tie_to_launcher()  # first: started by `banyan serve`, it dies with it
    ap = Parser(prog="banyan tokenizer", description="Banyan tokenizer service (gRPC and OpenAI-compatible HTTP APIs)")
    add_arguments(ap, TokenizerConfig)
    ns = ap.parse_args(argv)
    cfg = configured(ap.prog, ns.debug, lambda: from_namespace(TokenizerConfig, ns), TokenizerConfig)
    setup_logging("tokenizer", cfg.log_level, cfg.log_format)
    from shared.model_path import resolve_model

    configured(ap.prog, ns.debug, lambda: resolve_model(cfg.model))  # a bad model: one line, before the heavy imports
    from services.tokenizer.server import main_async

    main_async(cfg)
    end_process(0)  # (no interpreter teardown: see end_process)


if __name__ == "__main__":
    main()
