"""The HTTP pieces every face of the engine shares, free of torch so the Ray ingress can load them
without it: OpenAI's error shape and the handlers that answer in it, the JSON body's limits, the API
key check."""

from __future__ import annotations

import hmac
import json
import logging

from fastapi import (
    Request,  # at module level: the handlers' annotations are resolved from here
)
from starlette.requests import ClientDisconnect

from .guard import REFUSED

RETRY_AFTER_S = 5  # what a shutting-down or broken server tells clients to wait before retrying elsewhere


class ApiError(Exception):
    """An OpenAI-shaped error: {"error": {"message", "type", "param", "code"}} with its HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class ClientLeft(Exception):
    """The client hung up before its request was read (or the connection guard ended it): one line in
    the log where a client left (the message), none where the guard answered, and no answer."""


def is_json(content_type: str | None) -> bool:
    """A JSON media type (application/json or any +json), parameters aside. A browser sends anything
    else cross-site without asking the server first (a "simple request"): refusing it keeps a local
    server keyless yet out of reach of the pages its user visits."""
    media = (content_type or "").split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def _peer(request: Request) -> str:
    return request.client.host if request.client else "unknown"


async def read_json_body(request: Request, limit: int) -> bytes:
    """The body, refused with 415 unless it is declared JSON and with 413 once it passes the limit:
    by its Content-Length before any of it is read, or counted while a chunked one arrives."""
    if not is_json(request.headers.get("content-type")):
        raise ApiError(415, "send the body as JSON, with 'Content-Type: application/json' (curl: -H "
                            "'Content-Type: application/json'); other types are refused so that no web page "
                            "can make this server compute")
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise ApiError(400, "the Content-Length header is not a number")
        if int(declared) > limit:
            raise ApiError(413, f"the body is {int(declared)} bytes; the limit is {limit}")
    parts, size = [], 0
    try:
        async for part in request.stream():
            size += len(part)
            if size > limit:
                raise ApiError(413, f"the body is over {limit} bytes; the limit is {limit}")
            parts.append(part)
    except ClientDisconnect:
        guarded = REFUSED in request.scope  # the connection guard ended it (a body too slow): said by its 408
        raise ClientLeft(None if guarded else f"a client ({_peer(request)}) left after {size} bytes of its "
                                              "request body") from None
    return b"".join(parts)


class ApiKeyCheck:
    """ASGI middleware: every route but /health needs 'Authorization: Bearer KEY', compared in
    constant time. Plain ASGI (not BaseHTTPMiddleware), so disconnects reach the handlers as they are."""

    def __init__(self, app, api_key: str):
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] != "/health":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                e = ApiError(401, "a valid API key is required (Authorization: Bearer ...)", code="invalid_api_key",
                             kind="authentication_error")
                body = json.dumps(e.body()).encode()
                await send({"type": "http.response.start", "status": 401,
                            "headers": [(b"content-type", b"application/json"),
                                        (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


def answer_errors(app) -> None:
    """Every error an app raises answered in OpenAI's shape: `linnet serve`'s app and the Ray ingress's."""
    from fastapi.exceptions import (
        RequestValidationError,  # with FastAPI: `linnet[serve]` only
    )
    from fastapi.responses import (  # with FastAPI: `linnet[serve]` only
        JSONResponse,
        Response,
    )
    from starlette.exceptions import (
        HTTPException as StarletteHTTPException,  # FastAPI's dependency
    )

    @app.exception_handler(ApiError)
    async def api_error(request, e: ApiError):
        headers = {"Retry-After": str(RETRY_AFTER_S)} if e.status == 503 else None
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    @app.exception_handler(ClientLeft)
    async def client_left(request, e: ClientLeft):  # no traceback: a client may hang up at any time
        if e.args[0]:
            logging.getLogger("uvicorn.error").warning("%s", e.args[0])
        return Response(status_code=400)  # sent to no one

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, e):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(ApiError(e.status_code, str(e.detail), kind=kind).body(), status_code=e.status_code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, e):
        return JSONResponse(ApiError(400, "the request is malformed").body(), status_code=400)

    @app.exception_handler(Exception)
    async def unexpected(request, e):  # a bug: still an OpenAI-shaped error, never a bare 500 page
        return JSONResponse(ApiError(500, f"internal error: {type(e).__name__}", kind="server_error").body(),
                            status_code=500)
