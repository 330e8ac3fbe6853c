"""OpenAI-shaped error bodies ``{"error": {"message", "type", "param", "code"}}`` and the exception
handlers that map every failure to one: Banyan's errors by their status code, FastAPI's request
validation (422) as 400, unknown routes and methods, and anything unexpected as a logged 500.
Every 400 names its field in ``param`` (and in the message); every refused request is logged once,
at warning level, with its request id and the reason (``request_rejected``)."""

from __future__ import annotations

import json
import re
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from shared.errors import BanyanError
from shared.logging import get_logger
from services.tokenizer.http import fields
from services.tokenizer.http.protocol import ErrorDetail, ErrorResponse
from services.tokenizer.http.unserved import unserved

log = get_logger("tokenizer")

# BanyanError.code (a gRPC status name) → HTTP status and OpenAI error type
_BY_CODE: dict[str, tuple[int, str]] = {
    "INVALID_ARGUMENT": (400, "invalid_request_error"),
    "ALREADY_EXISTS": (409, "invalid_request_error"),
    "RESOURCE_EXHAUSTED": (429, "rate_limit_error"),
    "UNAVAILABLE": (503, "service_unavailable_error"),
    "INTERNAL": (500, "server_error"),
    "NOT_FOUND": (404, "not_found_error"),
    "FAILED_PRECONDITION": (400, "invalid_request_error"),
}
_MAX_LISTED = 3  # validation problems spelled out in one message


class ApiError(Exception):
    """An error with its HTTP status, e.g. an unknown model (404) or a bad API key (401)."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type, code, param

    def body(self) -> dict:
        detail = ErrorDetail(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=detail).model_dump()

    def response(self) -> JSONResponse:
        headers = {}
        if self.status in (429, 503):
            headers["Retry-After"] = "1"
        elif self.status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


_NAMES = sorted({r.name for r in fields.RULES} | {"prompt", "messages", "input", "n"}, key=len, reverse=True)
_PATH = r"((?:\[\d+\]|\.\w+)*)(?![\w-])"
_HEAD = re.compile(r"(" + "|".join(map(re.escape, _NAMES)) + r")" + _PATH)  # a message that starts with its field
# past the start, only names that cannot be ordinary words of a sentence ("the model's template …")
_INNER = [n for n in _NAMES if "_" in n] + ["prompt", "messages", "logprobs", "temperature", "seed", "tools"]
_NAME = re.compile(r"(?<![\w.-])(" + "|".join(map(re.escape, _INNER)) + r")" + _PATH)
_PROMPT = {fields.CHAT: "messages", fields.RESPONSES: "input"}  # what "the prompt" is called there


def param_of(message: str, endpoint: str | None = None) -> str | None:
    """The request field a validation message is about: the field it starts with (``messages[0].role
    …`` → ``messages.0.role``), else the first unmistakable field name in it ("the prompt has …" →
    ``prompt``, or ``messages`` / ``input`` on the chat / responses endpoints; a chat template's own
    error → ``messages``)."""
    if message.startswith("chat template failed"):
        return _PROMPT.get(endpoint or "", "messages")
    m = _HEAD.match(message) or _NAME.search(message)
    if m is None:
        return None
    name = m.group(1) + re.sub(r"\[(\d+)\]", r".\1", m.group(2))
    if m.group(1) == "prompt" and endpoint in _PROMPT:
        return _PROMPT[endpoint] + name[len("prompt"):]
    return name


def api_error(e: Exception, endpoint: str | None = None) -> ApiError:
    """Any exception as an ``ApiError`` (unexpected ones become a 500 and are logged)."""
    if isinstance(e, ApiError):
        return e
    if isinstance(e, BanyanError):
        status, type_ = _BY_CODE.get(e.code, (500, "server_error"))
        param = param_of(str(e), endpoint) if status == 400 else None
        return ApiError(status, str(e), type=type_, code=e.code.lower(), param=param)
    log.error("http_request_failed", error=repr(e), exc_info=e)
    return ApiError(500, f"internal error: {type(e).__name__}", type="server_error", code="internal")


def sse_error(e: Exception) -> str:
    """A failure after a stream began: one ``data:`` event with the error body."""
    return f"data: {json.dumps(api_error(e).body())}\n\n"


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "none", "constrained-int", "constrained-float",
                        "constrained-str"})


def _field(loc: tuple) -> str:
    """``("body", "prompt", "list[constrained-int]", 0)`` → ``"prompt.0"``: the field path without
    the body marker and pydantic's union-member tags (a model member's tag is its class name)."""
    return ".".join(str(x) for x in loc[1 if loc[:1] == ("body",) else 0:]
                    if not (isinstance(x, str) and ("[" in x or x in _TYPE_TAGS or x[:1].isupper())))


def _rank(kind: str) -> int:
    """Which of a union's failures explains the problem best: a failed rule ("must be valid
    Unicode"), then a broken bound ("greater than or equal to 0"), then a type mismatch ("should
    be a valid string") from the union members the value was never meant for."""
    return 0 if kind == "value_error" else 2 if kind.endswith("_type") else 1


def _validation_message(exc: RequestValidationError, endpoint: str | None) -> tuple[str, str | None]:
    by_field: dict[str, list[tuple[int, str]]] = {}  # a union's members fail at one field: one line per field
    for err in exc.errors():
        if err.get("type") == "json_invalid":
            return f"invalid JSON body: {err.get('ctx', {}).get('error', err['msg'])}", None
        if err.get("type") == "model_attributes_type" and tuple(err.get("loc", ())) == ("body",):
            return "the body must be a JSON object (send Content-Type: application/json)", None
        loc = tuple(err.get("loc", ()))
        if err.get("type") == "missing" and loc == ("body",):
            need = _PROMPT.get(endpoint or "", "prompt") if endpoint else None
            what = f" with {need} (required)" if need else ""
            return f"the request body is missing: send a JSON object{what} (Content-Type: application/json)", need
        if err.get("type") == "extra_forbidden":
            msg = (fields.refusal(endpoint, str(loc[-1])) if endpoint and len(loc) == 2 else None) or \
                "unrecognized request argument (not supported)"
        elif err.get("type") == "missing":
            msg = "is required"
        else:
            msg = str(err["msg"]).removeprefix("Value error, ")
        name = _field(loc) + (".content" if err.get("type") == "missing_content" else "")
        msgs = by_field.setdefault(name, [])
        if msg not in (m for _, m in msgs):
            msgs.append((_rank(str(err.get("type", ""))), msg))
    first = {name: min(msgs, key=lambda m: m[0]) for name, msgs in by_field.items()}  # ties: the earliest
    first = dict(sorted(first.items(), key=lambda item: item[1][0]))  # stable: else in order
    parts = [f"{name}: {msg}" if name else msg for name, (_, msg) in first.items()]
    more = len(parts) - _MAX_LISTED
    text = "; ".join(parts[:_MAX_LISTED]) + (f" (and {more} more)" if more > 0 else "")
    return text or "invalid request", next(iter(first), None) or None


def request_id(request: Request) -> str:
    """The request's id: the one its route took (``request.state.rid``), its X-Request-Id header, or a new one."""
    rid = getattr(request.state, "rid", None) or request.headers.get("x-request-id") or uuid.uuid4().hex
    request.state.rid = rid
    return rid


def rejected(request: Request, error: ApiError) -> JSONResponse:
    """The error's response; a refusal (4xx) is logged once, with the request id and the reason."""
    response = error.response()
    if error.status < 500:
        rid = request_id(request)
        log.warning("request_rejected", request_id=rid, method=request.method, path=request.url.path,
                    status=error.status, param=error.param, reason=error.message)
        response.headers["X-Request-Id"] = rid
    return response


def install(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _invalid(req: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc, fields.endpoint_of(req.url.path))
        return rejected(req, ApiError(400, message, code="invalid_argument", param=param))

    @app.exception_handler(HTTPException)
    async def _http(req: Request, exc: HTTPException) -> JSONResponse:
        type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
        detail = str(exc.detail)
        if isinstance(exc.__cause__, UnicodeDecodeError):  # FastAPI's "error parsing the body"
            detail = f"the body is not valid UTF-8: {exc.__cause__}"
        error = ApiError(exc.status_code, detail, type=type_)
        if exc.status_code == 404:
            status, message, code = unserved(req.method, req.url.path)
            error = ApiError(status, message, code=code)
        response = rejected(req, error)
        response.headers.update(exc.headers or {})  # e.g. Allow on 405
        return response

    @app.exception_handler(ApiError)
    async def _api(req: Request, exc: ApiError) -> JSONResponse:
        return rejected(req, exc)

    @app.exception_handler(BanyanError)
    async def _banyan(req: Request, exc: BanyanError) -> JSONResponse:
        return rejected(req, api_error(exc, fields.endpoint_of(req.url.path)))

    @app.exception_handler(Exception)
    async def _unexpected(req: Request, exc: Exception) -> JSONResponse:
        return rejected(req, api_error(exc))
