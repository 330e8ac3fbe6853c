"""Qwen3: the Llama decoder with a per-head RMSNorm on q and k before RoPE."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from services.worker.models.config import DecoderConfig
from services.worker.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def parse_config(cls, hf: Mapping[str, Any]) -> DecoderConfig:
        return dataclasses.replace(super().parse_config(hf), qk_norm=True)
