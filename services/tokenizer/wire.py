"""Why a request's bytes did not parse, in words a client can act on.

gRPC hands the servicer only what ``FromString`` parsed; bytes that do not parse (invalid UTF-8 in
a string field, a truncated or corrupt message) would otherwise end as UNKNOWN. ``explain`` walks
the protobuf wire format against the message's descriptor and names the first bad field, e.g.
``sampling_params.stop is not valid UTF-8``.
"""

from __future__ import annotations

from google.protobuf.descriptor import Descriptor, FieldDescriptor

_MAX_VARINT_BYTES = 10


class _Corrupt(Exception):
    pass


def _varint(data: bytes, i: int) -> tuple[int, int]:
    value, shift = 0, 0
    for k in range(_MAX_VARINT_BYTES):
        if i + k >= len(data):
            raise _Corrupt("it is truncated")
        b = data[i + k]
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, i + k + 1
        shift += 7
    raise _Corrupt("it has a malformed varint")


def _problem(desc: Descriptor, data: bytes, path: str) -> str | None:
    """The first problem in ``data`` (a serialized ``desc``), or None when none was found."""
    i, n = 0, len(data)
    while i < n:
        key, i = _varint(data, i)
        number, wire_type = key >> 3, key & 7
        if number == 0:
            raise _Corrupt("it has a field number 0")
        field = desc.fields_by_number.get(number)
        name = path + (field.name if field is not None else f"field {number}")
        if wire_type == 0:
            _, i = _varint(data, i)
        elif wire_type in (1, 5):
            i += 8 if wire_type == 1 else 4
        elif wire_type == 2:
            size, i = _varint(data, i)
            if i + size > n:
                raise _Corrupt(f"{name} is truncated")
            chunk, i = data[i:i + size], i + size
            if field is None:
                continue
            if field.type == FieldDescriptor.TYPE_STRING:
                try:
                    chunk.decode("utf-8")
                except UnicodeDecodeError:
                    return f"{name} is not valid UTF-8"
            elif field.type == FieldDescriptor.TYPE_MESSAGE:
                inner = _problem(field.message_type, chunk, name + ".")
                if inner:
                    return inner
        else:  # 3, 4: groups (not used by these messages); 6, 7: invalid
            raise _Corrupt(f"{name} has wire type {wire_type}")
        if i > n:
            raise _Corrupt(f"{name} is truncated")
    return None


def explain(desc: Descriptor, data: bytes) -> str:
    """A one-line reason why ``data`` is not a valid ``desc`` message."""
    try:
        reason = _problem(desc, bytes(data), "") or "it does not parse"
    except _Corrupt as e:
        reason = str(e)
    except RecursionError:
        reason = "it is nested too deeply"
    return f"the request is not a valid {desc.full_name}: {reason}"
