"""Resolve the ``--model`` setting shared by all services to a model directory and a default name.

A service always gets a model: ``banyan``'s commands put the embedded demo model's directory in
place of an empty ``--model`` before they build a configuration (the demo lives in ``banyan/``,
which nothing here imports)."""

from __future__ import annotations

import os
import re
from pathlib import Path

from shared import knobs
from shared.config import ConfigError

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # owner/name, as on the Hugging Face hub


def resolve_model(model: str, dtype: str = "auto") -> tuple[str, str]:
    """(directory, default served name) of ``model``: a HF model directory (named after it), a hub
    id whose snapshot is already in the local Hugging Face cache (named by the id; looked up
    offline, never downloaded), or a ``.gguf`` file (named after it; converted once into an HF
    directory with ``dtype`` weights in Banyan's cache: shared/gguf). Anything else is a
    ``ConfigError`` saying what to do (a ``GGUFError`` for a GGUF file that cannot be served)."""
    if model.endswith(".gguf") and not os.path.isdir(model):
        from shared.gguf.convert import converted_dir, weights_dtype

        return str(converted_dir(model, weights_dtype(dtype), cache_root() / "gguf")), Path(model).stem
    if not model:
        raise ConfigError("--model is empty: give a HF model directory or a hub id in the local Hugging Face "
                          "cache (the banyan command serves its demo model when none is given)")
    if os.path.isdir(model):
        if not os.path.isfile(os.path.join(model, "config.json")):
            raise ConfigError(f"--model {model!r} is not a HF model directory (no config.json)")
        return model, os.path.basename(os.path.normpath(model))
    if _HUB_ID.fullmatch(model):
        found, cache = cached_snapshot(model)
        if found:
            return found, model
        raise ConfigError(f"--model {model!r} is no directory, and the local Hugging Face cache ({cache}) has no "
                          f"complete snapshot of it; Banyan never downloads: fetch it first with "
                          f"`{download_command(model)}` or give its directory")
    raise ConfigError(f"--model {model!r} is neither a directory nor a Hugging Face hub id (owner/name)")


def download_command(repo_id: str) -> str:
    """The command that fetches ``repo_id`` into the local cache: ``hf``, the CLI of
    huggingface-hub >= 0.34 (what Banyan installs; the older ``huggingface-cli`` is gone from 1.0)."""
    return f"hf download {repo_id}"


def cached_snapshot(repo_id: str) -> tuple[str, str]:
    """(the cached snapshot directory of ``repo_id``'s main revision, or "" when there is none with
    a config.json; the cache directory). Reads the cache only: no network."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        path = snapshot_download(repo_id, local_files_only=True)
    except (LocalEntryNotFoundError, HFValidationError, FileNotFoundError):
        return "", constants.HF_HUB_CACHE
    return (path if os.path.isfile(os.path.join(path, "config.json")) else ""), constants.HF_HUB_CACHE


def cache_root() -> Path:
    """Banyan's cache folder (the demo model, built kernels): ``$BANYAN_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/banyan``, else ``~/.cache/banyan``."""
    if given := knobs.get("cache_dir", fresh=True):
        return Path(given).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "banyan"
    return Path.home() / ".cache" / "banyan"
