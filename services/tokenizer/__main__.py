"""``python -m services.tokenizer`` — run one tokenizer replica (flags or BANYAN_* env vars)."""

from __future__ import annotations

import argparse

from shared.config import TokenizerConfig, add_arguments, from_namespace
from shared.logging import setup_logging


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="banyan tokenizer",
                                 description="Banyan tokenizer service (gRPC and OpenAI-compatible HTTP APIs)")
    add_arguments(ap, TokenizerConfig)
    cfg = from_namespace(TokenizerConfig, ap.parse_args(argv))
    setup_logging("tokenizer", cfg.log_level, cfg.log_format)
    from services.tokenizer.server import main_async

    main_async(cfg)


if __name__ == "__main__":
    main()
