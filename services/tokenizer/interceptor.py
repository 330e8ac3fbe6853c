"""One server interceptor maps Banyan's errors to gRPC status codes for every RPC."""

from __future__ import annotations

import grpc

from shared.errors import BanyanError
from shared.logging import get_logger

log = get_logger("tokenizer")


async def _abort(context: grpc.aio.ServicerContext, e: Exception, method: str) -> None:
    if isinstance(e, BanyanError):
        await context.abort(getattr(grpc.StatusCode, e.code), str(e))
    log.exception("rpc_failed", method=method)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(e).__name__}")


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None:
            return None
        method = details.method
        if handler.unary_unary is not None:
            inner = handler.unary_unary

            async def unary(request, context):
                try:
                    return await inner(request, context)
                except grpc.aio.AbortError:
                    raise
                except Exception as e:
                    await _abort(context, e, method)

            return handler._replace(unary_unary=unary)
        if handler.unary_stream is not None:
            inner_stream = handler.unary_stream

            async def stream(request, context):
                try:
                    async for item in inner_stream(request, context):
                        yield item
                except grpc.aio.AbortError:
                    raise
                except Exception as e:
                    await _abort(context, e, method)

            return handler._replace(unary_stream=stream)
        return handler
