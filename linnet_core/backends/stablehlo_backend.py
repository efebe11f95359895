"""Backend `stablehlo` ("XLA (StableHLO)"): StableHLO text emitted from the IR, compiled by XLA
through JAX's PJRT client, run with the same contract (and buckets) as the JAX backend.

Each bucket's module text is kept in the artifact (`stablehlo/*.mlir`) with its serialized
executable (`*.xla`), written when first compiled, so a warm load deserializes instead of
compiling. An emitted module that XLA refuses is an emitter bug: it surfaces with XLA's message.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

from ..errors import IRError
from ..ir.graph import Graph
from ..ir.passes import optimize
from ..models import build_graph
from ..models.spec import ModelSpec, RopeSpec
from ..runtime.session import Session
from ..weights import Checkpoint
from .base import write_artifact_info
from .jax_backend import XlaBackend, XlaSession, import_jax, to_jax, warm_up
from .stablehlo_emit import emit_stablehlo, weight_order
from .torch_backend import load_prepared_weights, write_prepared_weights


def spec_from_json(d: dict) -> ModelSpec:
    return ModelSpec(**{**d, "rope": RopeSpec(**d["rope"]), "layer_windows": tuple(d["layer_windows"]),
                        "eos_token_ids": tuple(d["eos_token_ids"])})


def _write_atomic(path: Path, data: bytes | str) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
    tmp.write_bytes(data if isinstance(data, bytes) else data.encode())
    os.replace(tmp, path)


class StablehloSession(XlaSession):
    def __init__(self, artifact: Path, graph: Graph, weights: list, info: dict, rows: int, backend: str):
        super().__init__(info, rows, backend)
        self.artifact, self.graph, self.weights = artifact / "stablehlo", graph, weights
        self.executables: dict[tuple, object] = {}

    def executable(self, B: int, T: int, all_logits: bool):
        key = (B, T, all_logits)
        if key not in self.executables:
            self.executables[key] = self._compile(B, T, all_logits)
        return self.executables[key]

    def _compile(self, B: int, T: int, all_logits: bool):
        import jax
        from jax._src.lib import xla_client as xc
        from jax.extend.backend import get_backend

        backend = get_backend()
        devices = xc.DeviceList(tuple(jax.devices()[:1]))
        options = xc.CompileOptions()
        stem = f"rows{self.rows}_b{B}_t{T}{'_all' if all_logits else ''}"
        mlir, blob = self.artifact / f"{stem}.mlir", self.artifact / f"{stem}.{backend.platform}.xla"
        if blob.is_file():
            try:
                return backend.deserialize_executable(blob.read_bytes(), devices, options)
            except Exception:  # a stale or foreign executable: compile it again below
                pass
        text = emit_stablehlo(self.graph, self.dtype, self.cache_len, self.rows, B, T, all_logits)
        try:
            exe = backend.compile_and_load(text, devices, options)
        except Exception as e:  # XLA's diagnostic, first line
            raise IRError(f"XLA refused the emitted StableHLO ({stem}): {str(e).strip().splitlines()[0]}") from None
        self.artifact.mkdir(exist_ok=True)
        _write_atomic(mlir, text)
        _write_atomic(blob, exe.serialize())
        return exe

    def _device_step(self, ids, start, slots, last, all_logits: bool):
        import jax

        exe = self.executable(ids.shape[0], ids.shape[1], all_logits)
        args = self.weights + [self.k_cache, self.v_cache] + [jax.device_put(a) for a in (ids, start, slots, last)]
        results = exe.execute_sharded(args).disassemble_into_single_device_arrays()
        next_token, logits, self.k_cache, self.v_cache = (r[0] for r in results)
        return next_token, logits


class StablehloBackend(XlaBackend):
    name = "stablehlo"
    title = "XLA (StableHLO)"

    def compile(self, graph: Graph, ckpt: Checkpoint, dtype: str, cache_len: int, out: Path) -> None:
        graph = optimize(graph)
        write_prepared_weights(out / "weights.safetensors", graph, ckpt, dtype)
        write_artifact_info(out, graph, dtype, cache_len)
        (out / "stablehlo").mkdir()
        warm_up(self.load(out, rows=1))

    def load(self, artifact: Path, rows: int, device: str | None = None) -> Session:
        import_jax()
        info = json.loads((artifact / "artifact.json").read_text())
        spec = spec_from_json(json.loads((artifact / "graph.json").read_text())["meta"]["spec"])
        graph = optimize(build_graph(spec))
        host = load_prepared_weights(artifact / "weights.safetensors", "cpu")
        flat = {**host["global"], **{graph.block_param_name(k, i): t for i, layer in enumerate(host["layers"])
                                     for k, t in layer.items()}}
        weights = [to_jax(flat[name]) for name in weight_order(graph)]
        return StablehloSession(artifact, graph, weights, info, rows, self.name)
