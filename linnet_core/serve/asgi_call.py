"""One HTTP request through an ASGI app in this process, its response streamed back as it is sent:
how a Ray replica runs `linnet serve`'s own app (every route, check and error shape) on a request
the ingress forwards, with no socket between them. Leaving the iteration early (the client hung up)
tells the app its client disconnected, as uvicorn would, so the engine frees the request's row."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, AsyncIterator

LINGER_S = 5.0  # how long a response the caller left may take to wind down before it is cancelled


async def asgi_call(app, method: str, path: str, query: str, headers: list[tuple[bytes, bytes]],
                    body: bytes) -> AsyncIterator[dict[str, Any] | bytes]:
    """Yields {"status", "headers"} once, then the body's chunks (bytes)."""
    sent: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    body_read = False

    async def receive():
        nonlocal body_read
        if not body_read:
            body_read = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()  # the app listens for a disconnect while it streams
        return {"type": "http.disconnect"}

    async def send(message):
        await sent.put(message)

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": method, "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": "",
             "query_string": query.encode(), "headers": headers, "client": ("ray-ingress", 0),
             "server": ("linnet-replica", 0)}
    task = asyncio.ensure_future(app(scope, receive, send))
    try:
        while True:
            message = await _next(sent, task)
            if message is None:  # the app returned without finishing its response
                raise RuntimeError("the app ended without a complete response")
            if message["type"] == "http.response.start":
                yield {"status": message["status"], "headers": [(bytes(k), bytes(v)) for k, v in message["headers"]]}
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield bytes(message["body"])
                if not message.get("more_body", False):
                    return
    finally:
        gone.set()
        if not task.done():
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(task), LINGER_S)
            task.cancel()


async def _next(sent: asyncio.Queue, task: asyncio.Future) -> dict | None:
    """The app's next message, or None once the app is done and has sent everything."""
    if not sent.empty():
        return sent.get_nowait()
    got = asyncio.ensure_future(sent.get())
    await asyncio.wait({got, task}, return_when=asyncio.FIRST_COMPLETED)
    if got.done():
        return got.result()
    got.cancel()
    task.result()  # the app raised: raise it here
    return sent.get_nowait() if not sent.empty() else None
