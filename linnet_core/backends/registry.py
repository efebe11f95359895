"""Which backends exist (module:class by --backend name) and which have kernels for block-quantized
weights: plain data, so the CLI lists them and a backend refuses a format without importing any other."""

from __future__ import annotations

from ..dtypes import QUANTIZED

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
