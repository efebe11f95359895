"""Backend registry: one module per backend, found by its --backend name.

Names are known without importing any backend, so the CLI starts without loading torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from ..dtypes import DTYPES
from ..errors import InputError
from .registry import BACKEND_NAMES, QUANTIZED_ON, REGISTRY

if TYPE_CHECKING:
    from .base import Backend

_loaded: dict[str, "Backend"] = {}


def get_backend(name: str) -> "Backend":
    if name not in REGISTRY:
        raise InputError(f"unknown backend '{name}' (available: {', '.join(REGISTRY)})")
    if name not in _loaded:
        module, cls = REGISTRY[name].split(":")
        _loaded[name] = getattr(importlib.import_module(module), cls)()
    return _loaded[name]


__all__ = ["BACKEND_NAMES", "DTYPES", "QUANTIZED_ON", "REGISTRY", "get_backend"]
