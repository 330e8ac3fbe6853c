from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
# the start-up tunings time every shape in tests (no decisions from an earlier run); tests/gpu/test_tuning_cache_gpu.py
# turns the cache on in a folder of its own
os.environ["BANYAN_TUNING_CACHE"] = "0"


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    """One demo-model cache for the whole run, shared with the server subprocesses."""
    d = tmp_path_factory.mktemp("banyan-cache")
    os.environ["BANYAN_CACHE_DIR"] = str(d)
    return d


@pytest.fixture(scope="session")
def demo_dir(cache_dir) -> str:
    from banyan.demo import ensure_demo_model

    return ensure_demo_model(str(cache_dir))
