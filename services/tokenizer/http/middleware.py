"""The outermost ASGI layer of the HTTP front: API key, request size limit, request metrics.

A plain ASGI middleware (not Starlette's ``BaseHTTPMiddleware``), so streamed responses and
client disconnects pass through untouched and an in-flight request counts until its last byte.
"""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from shared.logging import get_logger
from services.tokenizer.auth import ApiKey
from services.tokenizer.http.errors import ApiError
from services.tokenizer.http.native import protocol as native
from services.tokenizer.metrics import TokenizerMetrics

OPEN_PATHS = (frozenset({"/health", "/metrics", "/openapi.json", "/docs", "/docs/oauth2-redirect"})
              | native.OPEN_PATHS)
OPEN_PREFIX = "/docs/assets/"  # Swagger UI's own files
log = get_logger("tokenizer")
MAX_BODY = 64 << 20  # bytes, as the gRPC front's message limit
KNOWN_PATHS = (frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/models", "/tokenize",
                          "/detokenize", "/tokenizer_info"}) | native.PATHS)


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value
    return None


def _endpoint(path: str) -> str:
    """A bounded metrics label: the route, or "other"."""
    if path in KNOWN_PATHS or path in OPEN_PATHS:
        return path
    if path.startswith(OPEN_PREFIX):
        return OPEN_PREFIX + "*"
    return "/v1/models/{model}" if path.startswith("/v1/models/") else "other"


def _limited(receive: Receive) -> Receive:
    """``receive`` that refuses a body (chunked, without Content-Length) beyond ``MAX_BODY``."""
    size = 0

    async def wrapped() -> Message:
        nonlocal size
        message = await receive()
        size += len(message.get("body", b""))
        if size > MAX_BODY:
            raise HTTPException(413, f"the request body is larger than {MAX_BODY} bytes")
        return message

    return wrapped


class Edge:
    def __init__(self, app: ASGIApp, api_key: ApiKey, metrics: TokenizerMetrics) -> None:
        self.app, self.api_key, self.metrics = app, api_key, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        endpoint = _endpoint(scope["path"])
        status = 500

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        in_flight = self.metrics.http_in_flight.labels(endpoint)
        in_flight.inc()
        try:
            error = self._refuse(scope)
            if error is not None:
                rid = (_header(scope, b"x-request-id") or b"").decode(errors="replace") or None
                log.warning("request_rejected", request_id=rid, method=scope.get("method"), path=scope["path"],
                            status=error.status, param=None, reason=error.message)
                await error.response()(scope, receive, send_status)
            else:
                await self.app(scope, _limited(receive), send_status)
        finally:
            in_flight.dec()
            self.metrics.http_requests.labels(endpoint, str(status)).inc()

    def _refuse(self, scope: Scope) -> ApiError | None:
        path = scope["path"]
        if path not in OPEN_PATHS and not path.startswith(OPEN_PREFIX) and not self.api_key.allows(
                _header(scope, b"authorization")):
            return ApiError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                            type="authentication_error", code="invalid_api_key")
        length = _header(scope, b"content-length")
        if length is not None and length.isdigit() and int(length) > MAX_BODY:
            return ApiError(413, f"the request body is larger than {MAX_BODY} bytes", code="request_too_large")
        return None
