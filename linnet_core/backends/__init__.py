"""Backend registry: one module per backend, found by its --backend name."""

from __future__ import annotations

from ..errors import BackendUnavailable, InputError
from .base import DTYPES, Backend
from .torch_backend import TorchBackend

BACKENDS: dict[str, Backend] = {b.name: b for b in (TorchBackend(),)}


def get_backend(name: str) -> Backend:
    try:
        return BACKENDS[name]
    except KeyError:
        raise InputError(f"unknown backend '{name}' (available: {', '.join(BACKENDS)})") from None


__all__ = ["BACKENDS", "DTYPES", "Backend", "BackendUnavailable", "get_backend"]
