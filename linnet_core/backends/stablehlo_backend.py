"""Backend `stablehlo` ("XLA (StableHLO)"): StableHLO text emitted from the IR, compiled by XLA
through JAX's PJRT client, run with the same contract (and buckets) as the JAX backend.

Each bucket's module text is kept in the artifact (`stablehlo/*.mlir`) with its serialized
executable (`*.xla`), written when first compiled, so a warm load deserializes instead of
compiling. An emitted module that XLA refuses is an emitter bug: it surfaces with XLA's message.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

from ..errors import IRError
from ..ir.graph import Graph
from ..runtime.session import Session
from .artifact import WEIGHTS_FILE, flat_weights, load_prepared_weights, read_graph, read_info, warm_up_shapes
from .jax_backend import XlaBackend, XlaSession, check_half_on_cpu, import_jax, jax_device, xla_weight
from .stablehlo_emit import emit_stablehlo


def _write_atomic(path: Path, data: bytes | str) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
    tmp.write_bytes(data if isinstance(data, bytes) else data.encode())
    os.replace(tmp, path)


class StablehloSession(XlaSession):
    def __init__(self, artifact: Path, graph: Graph, weights: list, info: dict, rows: int, backend: str, device):
        super().__init__(info, rows, backend, device)
        self.artifact, self.graph, self.weights = artifact / "stablehlo", graph, weights
        self.executables: dict[tuple, object] = {}

    def executable(self, B: int, T: int, all_logits: bool):
        key = (B, T, all_logits)
        if key not in self.executables:
            self.executables[key] = self._compile(B, T, all_logits)
        return self.executables[key]

    def _compile(self, B: int, T: int, all_logits: bool):
        from jax._src.lib import xla_client as xc

        backend = self.device.client  # the PJRT client of the session's device (CPU or CUDA)
        devices = xc.DeviceList((self.device,))
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

    def precompile(self, B: int, T: int, all_logits: bool = False) -> None:
        self.executable(B, T, all_logits)

    def _device_step(self, ids, start, slots, last, all_logits: bool):
        import jax

        exe = self.executable(ids.shape[0], ids.shape[1], all_logits)
        args = self.weights + [self.k_cache, self.v_cache] + [jax.device_put(a, self.device) for a in (ids, start, slots, last)]
        results = exe.execute_sharded(args).disassemble_into_single_device_arrays()
        next_token, logits, self.k_cache, self.v_cache = (r[0] for r in results)
        return next_token, logits


class StablehloBackend(XlaBackend):
    name = "stablehlo"
    title = "XLA (StableHLO)"

    def emit(self, graph: Graph, dtype: str, cache_len: int, out: Path) -> None:
        (out / "stablehlo").mkdir()  # one module per step shape, emitted when first compiled

    def finish(self, out: Path) -> None:
        # The modules are compiled from the graph alone: no weights are loaded at compile time.
        session = StablehloSession(out, read_graph(out), [], read_info(out), 1, self.name, jax_device(None))
        for B, T in warm_up_shapes(session.cache_len):
            session.precompile(B, T)

    def load(self, artifact: Path, rows: int, device: str | None = None) -> Session:
        import_jax()
        graph = read_graph(artifact)
        dev = jax_device(device)
        check_half_on_cpu(self.name, read_info(artifact)["dtype"], dev.platform)
        host = load_prepared_weights(artifact / WEIGHTS_FILE, "cpu")
        weights = []
        for (full, _, _), w in zip(graph.all_params(), flat_weights(graph, host)):
            array = xla_weight(w, host.format_of(full), dev)
            weights += list(array) if isinstance(array, tuple) else [array]  # emit_stablehlo's arguments
            host.release(full)  # XLA holds its own copy now
        return StablehloSession(artifact, graph, weights, read_info(artifact), rows, self.name, dev)
