"""Fixtures shared by the end-to-end modules. Each module defines its own ``server`` (a
``support.Server`` with the flags it needs); ``stub`` talks gRPC to whichever that is."""

from __future__ import annotations

import pytest

from shared.proto.banyan.v1 import generation_pb2_grpc as pb_grpc


@pytest.fixture(scope="module")
def stub(server):
    with server.channel() as ch:
        yield pb_grpc.GenerationServiceStub(ch)
