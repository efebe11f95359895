"""Serving: the continuous-batching engine (`engine.py`) and the faces that drive it: OpenAI-compatible
HTTP (`http.py`) and Triton Inference Server (`triton.py`, `triton_model.py`)."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port nothing listens on now (for servers started locally by tests and benches)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
