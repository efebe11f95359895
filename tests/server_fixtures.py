"""Servers for the serving tests: an app in a thread, and waiting for a server process to answer."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import httpx


@contextmanager
def app_in_thread(app, **options):
    """Serve an ASGI app with uvicorn on a free local port in a thread (`options`: more uvicorn.Config
    settings); yields its base URL."""
    import uvicorn

    from linnet_core.serve import free_port

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error", **options))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def wait_healthy(url: str, seconds: float = 120) -> bool:
    """Whether `url`/health answered 200 within `seconds` (a server process starting up)."""
    deadline = time.time() + seconds
    while time.time() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return True
        except httpx.HTTPError:
            time.sleep(0.1)
    return False
