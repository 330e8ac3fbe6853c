"""Fixtures shared by the end-to-end modules. Each module defines its own ``server`` (a
``support.Server`` with the flags it needs); ``stub`` talks gRPC to whichever that is."""

from __future__ import annotations

import pytest

from shared.proto.banyan.v1 import generation_pb2_grpc as pb_grpc


@pytest.fixture(scope="module")
def stub(server):
    with server.channel() as ch:
        yield pb_grpc.GenerationServiceStub(ch)


@pytest.fixture(scope="session")
def hf(demo_dir):
    """The demo model and its tokenizer loaded with HF transformers in fp32: the independent reference
    the modules compare Banyan's tokens and log-probs with (a module may define its own ``hf``)."""
    import torch
    import transformers

    torch.set_num_threads(2)
    model = transformers.AutoModelForCausalLM.from_pretrained(demo_dir, dtype=torch.float32).eval()
    return model, transformers.AutoTokenizer.from_pretrained(demo_dir)

