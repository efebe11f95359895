"""What a backend is: an emitter that writes an artifact folder, and a loader that runs it.

`compile` is one template for every backend: lower the graph (the default passes, then the
ragged form where the backend takes ragged steps), check it against the checkpoint before a
byte is written, emit the code, write the weights, write the info, then build what the first
load would otherwise build. A backend fills in `emit` and `load`, and overrides the other steps
only where its artifact differs (see docs/adding-a-backend.md).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

from .. import params as prepared
from ..dtypes import DTYPES, FORMATS, compute_dtype
from ..errors import BackendUnavailable
from ..ir.graph import Graph
from ..ir.passes import optimize
from ..ir.ragged import to_ragged
from ..runtime.session import Session
from ..weight_store import Placer, fingerprint, write_here
from ..weights import Checkpoint
from .artifact import WEIGHTS_FILE, write_artifact_info, write_prepared_weights
from .registry import QUANTIZED_ON


class Backend(ABC):
    name: str  # the CLI's --backend value
    title: str  # how pages and tables name it
    stack: str  # the ecosystem it runs in, as bench pages group rows: PyTorch, JAX, ONNX Runtime and TensorRT
    dtypes: tuple[str, ...] = DTYPES
    ragged: bool = False  # emits the ragged step (ir.ragged): every session step is one call
    int8_activations_on_cpu: bool = False  # its CPU kernels for q-formats round activations to int8 blocks
    artifact_format = "1"  # bump when the artifact's files or their meaning change
    copies_of_tied = 1  # how often its layout stores a tied output head
    loads_at_compile = False  # whether `finish` runs a session (so a compile needs a session's memory)

    @abstractmethod
    def toolchain(self) -> dict[str, str]:
        """Versions of what builds and runs the artifact (the cache key adds `artifact_format` itself)."""

    def cache_toolchain(self) -> dict[str, str]:
        """What of this backend keys the artifact cache: its toolchain's versions and its artifact format."""
        return {**self.toolchain(), "format": self.artifact_format}

    def check_available(self, dtype: str) -> None:
        """Raise BackendUnavailable, saying why in one line, when this backend cannot run here."""
        return None

    def check_format(self, dtype: str) -> None:
        """Refuse a block-quantized format this backend has no kernels for, naming those that do
        (never a silent dequantization to float32 at load)."""
        if FORMATS[dtype].quantized and dtype not in QUANTIZED_ON.get(self.name, ()):
            runs = ", ".join(name for name, formats in QUANTIZED_ON.items() if dtype in formats)
            raise BackendUnavailable(f"the {self.name} backend has no kernels for {dtype} weights yet; "
                                     f"{dtype} runs on: {runs}", hint="choose one of those backends, or a float --dtype")

    def activations(self, dtype: str, device: str = "cpu") -> str:
        """What its matmuls hold activations in under `dtype` on `device`: the compute dtype, or
        "int8" where the kernels quantize them (verify holds the result to that precision's tolerance)."""
        if self.int8_activations_on_cpu and FORMATS[dtype].quantized and device == "cpu":
            return "int8"
        return compute_dtype(dtype)

    def check_device(self, device: str) -> None:
        """Raise BackendUnavailable when this backend cannot run on `device` ("cpu" or "cuda") here;
        a backend never falls back to another device than the one asked for."""
        if device == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise BackendUnavailable(f"{self.title} on CUDA needs an NVIDIA GPU, and none is visible here")
        elif device != "cpu":
            raise BackendUnavailable(f"unknown device '{device}' (choose from: cpu, cuda)")

    def default_device(self) -> str:
        """Where a session goes when the caller names no device: the GPU when this backend can use one."""
        try:
            self.check_device("cuda")
        except BackendUnavailable:
            return "cpu"
        return "cuda"

    def kv_cache_dtype(self, dtype: str) -> str:
        """The dtype this backend's sessions hold the KV cache in under storage format `dtype`."""
        return compute_dtype(dtype)

    def weight_copies(self, dtype: str, device: str) -> float:
        """A session's resident memory per byte of prepared weights (memory.check_fits): one, since
        loaders map the weights or release the originals of what they copy."""
        return 1.0

    def lower(self, graph: Graph) -> Graph:
        """The graph this backend emits."""
        g = optimize(graph)
        return to_ragged(g) if self.ragged else g

    def compile(self, graph: Graph, ckpt: Checkpoint, dtype: str, cache_len: int, out: Path,
                place: Placer = write_here) -> None:
        """Write the artifact's files into `out` (a fresh temporary folder); the weights go through
        `place`, which links them from the cache's store when another entry already holds them."""
        graph = self.lower(graph)
        prepared.check_against(graph, ckpt)  # names and shapes, before anything is written
        emitted = self.emit(graph, dtype, cache_len, out)
        self.write_weights(graph, ckpt, dtype, out, emitted, place)
        write_artifact_info(out, graph, dtype, cache_len, format=self.artifact_format, **self.artifact_extra(graph))
        self.finish(out)

    @abstractmethod
    def emit(self, graph: Graph, dtype: str, cache_len: int, out: Path) -> Any:
        """Write the artifact's code (a module, a graph); returns what `write_weights` may need."""

    def write_weights(self, graph: Graph, ckpt: Checkpoint, dtype: str, out: Path, emitted: Any,
                      place: Placer) -> None:
        """The prepared weights, in the compile dtype, as the passes fused them: one layout for every
        backend that loads them, so all of them (and every cache length) share one stored copy."""
        place(out / WEIGHTS_FILE, "safetensors", fingerprint(prepared.layout(graph, dtype)),
              lambda path: write_prepared_weights(path, graph, ckpt, dtype))

    def artifact_extra(self, graph: Graph) -> dict[str, Any]:
        """Backend-specific entries of artifact.json."""
        return {}

    def finish(self, out: Path) -> None:
        """Build into the artifact what the first load would otherwise build (engines, compiled
        buckets), so every later run is a load."""

    @abstractmethod
    def load(self, artifact: Path, rows: int, device: str | None = None) -> Session:
        """A ready session over a complete artifact folder."""
