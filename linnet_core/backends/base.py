"""What a backend is: an emitter that writes an artifact folder, and a loader that runs it."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

from ..ir.graph import Graph
from ..runtime.session import Session
from ..weights import Checkpoint
from . import DTYPES



class Backend(ABC):
    name: str  # the CLI's --backend value
    title: str  # how pages and tables name it
    stack: str  # the ecosystem it runs in, as bench pages group rows: PyTorch, JAX, ONNX Runtime and TensorRT
    dtypes: tuple[str, ...] = DTYPES

    @abstractmethod
    def toolchain(self) -> dict[str, str]:
        """Versions that change the artifact; part of the cache key."""

    def check_available(self, dtype: str) -> None:
        """Raise BackendUnavailable, saying why in one line, when this backend cannot run here."""
        return None

    @abstractmethod
    def compile(self, graph: Graph, ckpt: Checkpoint, dtype: str, cache_len: int, out: Path) -> None:
        """Write the artifact's files into `out` (a fresh temporary folder)."""

    @abstractmethod
    def load(self, artifact: Path, rows: int, device: str | None = None) -> Session:
        """A ready session over a complete artifact folder."""


def write_artifact_info(out: Path, graph: Graph, dtype: str, cache_len: int, **extra: Any) -> None:
    info = {
        "dtype": dtype,
        "cache_len": cache_len,
        "cache": vars(graph.cache),
        "vocab_size": graph.meta["spec"]["vocab_size"],
        "model_type": graph.meta["model_type"],
        **extra,
    }
    (out / "artifact.json").write_text(json.dumps(info, indent=2))
    (out / "graph.json").write_text(json.dumps(graph.to_json(), indent=1))
