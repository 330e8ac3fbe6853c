"""``GET /get_model_info`` and ``GET /server_info`` in SGLang's shapes, from what a replica knows:
the engine's ``ModelInfo``, the model directory's ``config.json`` and each group's load."""

from __future__ import annotations

import json
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.tokenizer.http.app import Frontend


def _version() -> str:
    try:
        return version("banyan")
    except PackageNotFoundError:
        return "unknown"


def _hf_config(front: Frontend) -> dict:
    path = Path(getattr(front.text.tokenizer, "name_or_path", "") or ".") / "config.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def model_info(front: Frontend) -> dict:
    info = front.model()
    cfg = _hf_config(front)
    return {"model_path": info.model, "served_model_name": info.model,
            "tokenizer_path": front.text.tokenizer.name_or_path, "is_generation": True,
            "preferred_sampling_params": None, "weight_version": "default", "load_format": "safetensors",
            "reasoning_parser": None, "tool_call_parser": None, "disaggregation_mode": "null",
            "has_image_understanding": False, "has_audio_understanding": False,
            "model_type": cfg.get("model_type"), "architectures": cfg.get("architectures") or [info.architecture]}


async def server_info(front: Frontend) -> dict:
    info = front.model()
    loads = await front.client.loads()
    states = []
    for g, load in enumerate(loads):
        used = load.kv_pool - load.kv_free - load.kv_evictable
        computed = load.prefill_computed_tokens + load.prefill_cached_tokens
        states.append({"dp_rank": g, "num_running_reqs": load.num_running, "num_waiting_reqs": load.num_waiting,
                       "max_total_num_tokens": load.kv_pool, "num_used_tokens": used,
                       "token_usage": used / load.kv_pool if load.kv_pool else 0.0,
                       "cache_hit_rate": load.prefill_cached_tokens / computed if computed else 0.0})
    return {"model_path": info.model, "tokenizer_path": front.text.tokenizer.name_or_path,
            "served_model_name": info.model, "context_length": info.context_length,
            "max_total_num_tokens": info.pool_size, "max_running_requests": info.max_running_requests,
            "dp_size": len(loads), "device": info.device, "dtype": info.dtype, "vocab_size": info.vocab_size,
            "eos_token_ids": list(info.eos_token_ids), "internal_states": states, "version": _version(),
            "frontend": "banyan"}
