"""Qwen2: the Llama decoder with biases on the q/k/v projections (none on o_proj)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from services.worker.models.config import DecoderConfig
from services.worker.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def parse_config(cls, hf: Mapping[str, Any]) -> DecoderConfig:
        return dataclasses.replace(super().parse_config(hf), qkv_bias=True, o_bias=False)
