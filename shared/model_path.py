"""Resolve the ``--model`` setting shared by all services to a model directory and a name."""

from __future__ import annotations

import os

from shared.config import ConfigError

DEMO_NAME = "banyan-demo"


def resolve_model(model: str) -> tuple[str, str]:
    """(directory, served name). Empty ``model`` → the embedded demo model (built offline once)."""
    if not model:
        from banyan.demo import ensure_demo_model

        return ensure_demo_model(), DEMO_NAME
    if not os.path.isfile(os.path.join(model, "config.json")):
        raise ConfigError(f"--model {model!r} is not a HF model directory (no config.json)")
    return model, os.path.basename(os.path.normpath(model))
