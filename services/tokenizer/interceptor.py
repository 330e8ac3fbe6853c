"""Server interceptors: the API key check (UNAUTHENTICATED) and the mapping of Banyan's errors
to gRPC status codes, for every RPC. Request bytes that do not parse (invalid UTF-8 in a string
field, a corrupt message) are INVALID_ARGUMENT naming the bad field, not UNKNOWN."""

from __future__ import annotations

import grpc

from shared.errors import BanyanError, ResourceExhausted
from shared.logging import get_logger
from services.tokenizer import wire
from services.tokenizer.auth import ApiKey

log = get_logger("tokenizer")
OPEN_SERVICES = ("/grpc.health.v1.Health/",)  # callable without the API key


def _retry_status(e: ResourceExhausted):
    """RESOURCE_EXHAUSTED with a google.rpc.RetryInfo detail (standard client retry hint)."""
    from google.protobuf import any_pb2, duration_pb2
    from google.rpc import code_pb2, error_details_pb2, status_pb2
    from grpc_status import rpc_status

    detail = any_pb2.Any()
    secs = int(e.retry_after_s)
    detail.Pack(error_details_pb2.RetryInfo(retry_delay=duration_pb2.Duration(
        seconds=secs, nanos=int((e.retry_after_s - secs) * 1e9))))
    return rpc_status.to_status(status_pb2.Status(code=code_pb2.RESOURCE_EXHAUSTED, message=str(e), details=[detail]))


_REFUSALS = frozenset({"INVALID_ARGUMENT", "FAILED_PRECONDITION", "NOT_FOUND", "ALREADY_EXISTS", "RESOURCE_EXHAUSTED",
                       "UNAUTHENTICATED"})


def rejected(context: grpc.aio.ServicerContext, method: str, code: str, reason: str) -> None:
    """A refused call's one warning line (the HTTP front logs its refusals the same way)."""
    if code in _REFUSALS:
        rid = next((v for k, v in context.invocation_metadata() or () if k == "x-request-id"), None)
        log.warning("request_rejected", request_id=rid, method=method, code=code, reason=reason)


async def _abort(context: grpc.aio.ServicerContext, e: Exception, method: str) -> None:
    if isinstance(e, BanyanError):
        rejected(context, method, e.code, str(e))
    if isinstance(e, ResourceExhausted):
        await context.abort_with_status(_retry_status(e))
    if isinstance(e, BanyanError):
        await context.abort(getattr(grpc.StatusCode, e.code), str(e))
    log.exception("rpc_failed", method=method)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(e).__name__}")


class _Undecodable:
    """Stands in for a request whose bytes did not parse; the handler answers INVALID_ARGUMENT."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _tolerant(deserializer):
    """``deserializer`` (a message class's ``FromString``) that returns ``_Undecodable`` instead of
    raising (gRPC would answer UNKNOWN)."""
    message_class = getattr(deserializer, "__self__", None)
    if deserializer is None or not hasattr(message_class, "DESCRIPTOR"):
        return deserializer

    def deserialize(data: bytes):
        try:
            return deserializer(data)
        except Exception:  # DecodeError; anything else a parser may raise on hostile bytes
            return _Undecodable(wire.explain(message_class.DESCRIPTOR, data))

    return deserialize


async def _check_decoded(request, context: grpc.aio.ServicerContext) -> None:
    if isinstance(request, _Undecodable):
        rejected(context, "", "INVALID_ARGUMENT", request.reason)
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.reason)


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None:
            return None
        method = details.method
        if handler.unary_unary is not None:
            inner = handler.unary_unary

            async def unary(request, context):
                await _check_decoded(request, context)
                try:
                    return await inner(request, context)
                except grpc.aio.AbortError:
                    raise
                except Exception as e:
                    await _abort(context, e, method)

            return handler._replace(unary_unary=unary, request_deserializer=_tolerant(handler.request_deserializer))
        if handler.unary_stream is not None:
            inner_stream = handler.unary_stream

            async def stream(request, context):
                await _check_decoded(request, context)
                try:
                    async for item in inner_stream(request, context):
                        yield item
                except grpc.aio.AbortError:
                    raise
                except Exception as e:
                    await _abort(context, e, method)

            return handler._replace(unary_stream=stream, request_deserializer=_tolerant(handler.request_deserializer))
        return handler


def _metadata(details: grpc.HandlerCallDetails, key: str) -> str | None:
    for k, v in details.invocation_metadata or ():
        if k == key:
            return v if isinstance(v, str) else v.decode("latin-1")
    return None


def _deny(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """The same method (same (de)serializers), answering UNAUTHENTICATED."""
    message = "missing or invalid API key: send metadata 'authorization: Bearer <key>'"

    async def unary(_request, context):
        rejected(context, "", "UNAUTHENTICATED", message)
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def stream(_request, context):
        rejected(context, "", "UNAUTHENTICATED", message)
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover - makes this an async generator

    if handler.unary_unary is not None:
        return handler._replace(unary_unary=unary)
    if handler.stream_unary is not None:
        return handler._replace(stream_unary=unary)
    if handler.unary_stream is not None:
        return handler._replace(unary_stream=stream)
    return handler._replace(stream_stream=stream)


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Every RPC but health needs ``authorization: Bearer <key>`` when a key is configured."""

    def __init__(self, api_key: ApiKey) -> None:
        self.api_key = api_key

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_SERVICES):
            return handler
        if self.api_key.allows(_metadata(details, "authorization")):
            return handler
        return _deny(handler)
