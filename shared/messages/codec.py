"""The one codec for internal messages: a version byte + msgpack of a tagged struct union."""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import msgspec

WIRE_VERSION = 1

T = TypeVar("T")


class WireError(ValueError):
    """A frame that is not a valid message of the expected channel and version."""


class Codec(Generic[T]):
    """Encode/decode the message union ``T`` of one channel."""

    def __init__(self, union: Any) -> None:
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(union)
        self._prefix = bytes([WIRE_VERSION])

    def encode(self, msg: T) -> bytes:
        return self._prefix + self._enc.encode(msg)

    def decode(self, frame: bytes | memoryview) -> T:
        data = memoryview(frame)
        if len(data) == 0 or data[0] != WIRE_VERSION:
            got = data[0] if len(data) else None
            raise WireError(f"wire version {got} != {WIRE_VERSION}")
        try:
            return self._dec.decode(data[1:])
        except msgspec.DecodeError as e:
            raise WireError(str(e)) from e
