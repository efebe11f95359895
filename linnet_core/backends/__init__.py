"""Backend registry: one module per backend, found by its --backend name.

Names are known without importing any backend, so the CLI starts without loading torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from ..dtypes import DTYPES, QUANTIZED
from ..errors import InputError

if TYPE_CHECKING:
    from .base import Backend

REGISTRY: dict[str, str] = {
    "torch": "linnet_core.backends.torch_backend:TorchBackend",
    "onnxruntime": "linnet_core.backends.ort_backend:OnnxRuntimeBackend",
    "tensorrt": "linnet_core.backends.tensorrt_backend:TensorRTBackend",
    "jax": "linnet_core.backends.jax_backend:JaxBackend",
    "stablehlo": "linnet_core.backends.stablehlo_backend:StablehloBackend",
    "inductor": "linnet_core.backends.inductor_backend:InductorBackend",
    "cudagraphs": "linnet_core.backends.inductor_backend:CudaGraphsBackend",
}
BACKEND_NAMES = tuple(REGISTRY)
# Backends with kernels for block-quantized weights: the others refuse those formats by name.
QUANTIZED_ON: dict[str, tuple[str, ...]] = {
    name: QUANTIZED for name in ("torch", "inductor", "cudagraphs", "onnxruntime", "jax", "stablehlo")}
_loaded: dict[str, "Backend"] = {}


def get_backend(name: str) -> "Backend":
    if name not in REGISTRY:
        raise InputError(f"unknown backend '{name}' (available: {', '.join(REGISTRY)})")
    if name not in _loaded:
        module, cls = REGISTRY[name].split(":")
        _loaded[name] = getattr(importlib.import_module(module), cls)()
    return _loaded[name]


__all__ = ["BACKEND_NAMES", "DTYPES", "QUANTIZED_ON", "REGISTRY", "get_backend"]
