"""Errors with a public meaning. Each maps to one gRPC status code (and later an HTTP status)."""

from __future__ import annotations

from shared.messages.common import ErrorCode


class BanyanError(Exception):
    """Base of errors reported to clients. ``code`` names a ``grpc.StatusCode`` member."""

    code = "INTERNAL"


class InvalidArgument(BanyanError):
    code = "INVALID_ARGUMENT"


class AlreadyExists(BanyanError):
    code = "ALREADY_EXISTS"


class Unavailable(BanyanError):
    code = "UNAVAILABLE"


class ResourceExhausted(BanyanError):
    """Overload: the client should retry after ``retry_after_s`` (gRPC RetryInfo, HTTP Retry-After)."""

    code = "RESOURCE_EXHAUSTED"
    retry_after_s = 1.0


class Internal(BanyanError):
    code = "INTERNAL"


class NotFound(BanyanError):
    """A named thing that does not exist (any more): a session that expired or was closed, a pin."""

    code = "NOT_FOUND"


class FailedPrecondition(BanyanError):
    """The request is valid but the state it needs does not hold (a session too full for the turn)."""

    code = "FAILED_PRECONDITION"


# TokenOut.error_code → exception class
BY_WIRE_CODE: dict[ErrorCode, type[BanyanError]] = {
    ErrorCode.INVALID_ARGUMENT: InvalidArgument,
    ErrorCode.ALREADY_EXISTS: AlreadyExists,
    ErrorCode.UNAVAILABLE: Unavailable,
    ErrorCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    ErrorCode.INTERNAL: Internal,
    ErrorCode.NOT_FOUND: NotFound,
    ErrorCode.FAILED_PRECONDITION: FailedPrecondition,
}
