"""Servers for the serving tests: an app in a thread, and waiting for a server process to answer."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import httpx


@contextmanager
def served_checkpoint(path, cache_len: int, rows: int = 4, prefill_chunk: int = 32):
    """`linnet serve`'s app over a float32 torch session of `path` in a thread; yields (url, engine,
    a one-row session of the same model for each request's answer alone, tokenizer)."""
    from linnet_core.compile import load_model
    from linnet_core.serve.engine import Engine
    from linnet_core.serve.http import Limits, Server, create_app
    from linnet_core.tokenizer import Tokenizer

    session, _ = load_model(path, "torch", "float32", cache_len, rows=rows)
    alone, _ = load_model(path, "torch", "float32", cache_len, rows=1)
    tok = Tokenizer(path)
    engine = Engine(session, tok, prefill_chunk=prefill_chunk)
    with app_in_thread(create_app(Server(engine, tok, "tiny", Limits(max_tokens=cache_len)))) as url:
        yield url, engine, alone, tok


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


def built_llama_server() -> str | None:
    """llama-server where this machine has one: on PATH, LINNET_LLAMA_SERVER, or built under the
    user's own cache (the tests point LINNET_CACHE elsewhere)."""
    import os
    import shutil
    from pathlib import Path

    from linnet_core.bench import llama_server

    built = llama_server.built_path(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "linnet")
    return os.environ.get("LINNET_LLAMA_SERVER") or shutil.which("llama-server") or (
        str(built) if built.exists() else None)


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
