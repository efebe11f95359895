"""Serving: the continuous-batching engine (`engine.py`) and the faces that drive it: OpenAI-compatible
HTTP (`http.py`) and Triton Inference Server (`triton.py`, `triton_model.py`)."""

from __future__ import annotations

import asyncio
import socket
import threading
from typing import Any


def free_port() -> int:
    """A TCP port nothing listens on now (for servers started locally by tests and benches)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Mailbox:
    """Hands items from the engine's thread to one asyncio loop: one wake-up per burst (a step's
    deltas for every request), not one per token, so the loop steals the step's cores less often."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._items: list[tuple[asyncio.Queue, Any]] = []
        self._lock = threading.Lock()

    def post(self, queue: asyncio.Queue, item: Any) -> None:
        with self._lock:
            self._items.append((queue, item))
            if len(self._items) > 1:  # a wake-up is already on its way
                return
        self.loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:
        with self._lock:
            items, self._items = self._items, []
        for queue, item in items:
            queue.put_nowait(item)
