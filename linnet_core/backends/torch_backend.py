"""Backend `torch` ("generated PyTorch"): the emitted module, run eagerly over a static KV cache.

The artifact holds `model.py` (from torch_emit), `weights.safetensors` (prepared weights in the
compile dtype, fused as the passes decided) and `artifact.json`. Loading maps the weights from
disk without copying them when they are already in the right dtype and device.
"""

from __future__ import annotations

import hashlib
import linecache
import json
import sys
import types
from pathlib import Path
from typing import Any, Sequence

import torch

from .. import params as prepared
from ..errors import BackendUnavailable
from ..ir.graph import Graph
from ..ir.passes import optimize
from ..runtime.ragged import ragged_layout
from ..runtime.session import Chunk, Session
from ..weights import Checkpoint, write_safetensors
from .base import Backend, write_artifact_info
from .cpu_kernels import pack_linear_weights
from .torch_emit import emit

TORCH_DTYPES = prepared.TORCH_DTYPES


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def import_generated(path: Path, prefix: str):
    """Import a generated module, named after its content.

    Name and code filename are the same in every process and folder, since compilers key their
    on-disk caches on them; the modules are stateless, so artifacts with one code share one.
    """
    source = path.read_bytes()
    name = f"{prefix}_{hashlib.sha256(source).hexdigest()[:16]}"
    if name in sys.modules:
        return sys.modules[name]
    module = types.ModuleType(name)
    module.__file__ = f"<linnet-generated>/{name}.py"
    code = compile(source, module.__file__, "exec")
    linecache.cache[module.__file__] = (len(source), None, source.decode().splitlines(True), module.__file__)
    sys.modules[name] = module  # compilers (dynamo) look functions' globals up by module name
    exec(code, module.__dict__)
    return module


ALIASES_KEY = "linnet.aliases"


def write_prepared_weights(path: Path, graph: Graph, ckpt: Checkpoint, dtype: str) -> None:
    entries, aliases = prepared.layout(graph, dtype)
    write_safetensors(path, entries, prepared.produce(graph, ckpt, dtype), metadata={ALIASES_KEY: json.dumps(aliases)})


def load_prepared_weights(path: Path, device: str) -> dict[str, Any]:
    """{"global": {...}, "layers": [{...}, ...]} from a prepared safetensors file (mapped, not read)."""
    ckpt = Checkpoint([path])
    flat = {name: ckpt.get(name) for name in ckpt.tensors}
    if device != "cpu":
        flat = {k: v.to(device) for k, v in flat.items()}
    for alias, target in json.loads(ckpt.metadata.get(ALIASES_KEY, "{}")).items():
        flat[alias] = flat[target]
    layers: dict[int, dict[str, torch.Tensor]] = {}
    glob: dict[str, torch.Tensor] = {}
    for name, t in flat.items():
        if name.startswith("blk."):
            _, idx, local = name.split(".", 2)
            layers.setdefault(int(idx), {})[local] = t
        else:
            glob[name] = t
    return {"global": glob, "layers": [layers[i] for i in sorted(layers)]}


class TorchSession(Session):
    def __init__(self, module, weights: dict[str, Any], info: dict, rows: int, device: str, backend: str):
        self.module, self.weights, self.backend = module, weights, backend
        self.dtype, self.cache_len, self.vocab_size, self.rows = info["dtype"], info["cache_len"], info["vocab_size"], rows
        self.device = torch.device(device)
        c = info["cache"]
        shape = (c["layers"], rows, c["kv_heads"], self.cache_len, c["head_dim"])
        self.k_cache = torch.zeros(shape, dtype=TORCH_DTYPES[self.dtype], device=self.device)
        self.v_cache = torch.zeros_like(self.k_cache)
        self.step_fn = module.step

    def _run(self, ids: Sequence[Sequence[int]], start: Sequence[int], slots: Sequence[int], all_logits: bool):
        kv_len = max(s + len(row) for s, row in zip(start, ids))
        with torch.inference_mode():
            ids_t = torch.tensor(ids, dtype=torch.int64, device=self.device)  # [B, T]
            start_t = torch.tensor(start, dtype=torch.int64, device=self.device)  # [B]
            slots_t = torch.tensor(slots, dtype=torch.int64, device=self.device)  # [B]
            last = torch.full((len(ids),), len(ids[0]) - 1, dtype=torch.int64, device=self.device)  # [B]
            return self.step_fn(self.weights, ids_t, start_t, slots_t, last, kv_len, self.k_cache, self.v_cache,
                                all_logits)

    def _run_chunks(self, chunks: Sequence[Chunk]) -> list[int]:
        """The step as one ragged call: linear layers over all its tokens at once."""
        lay = ragged_layout([c.ids for c in chunks], [c.start for c in chunks], [c.slot for c in chunks])
        dev = self.device

        def t(values, *shape):
            return torch.tensor(values, dtype=torch.int64, device=dev).reshape(*shape)

        n = len(lay.ids)
        ragged = {"pos": t(lay.pos, 1, n), "token_slots": t(lay.token_slots, 1, n), "d_slots": t(lay.d_slots, -1),
                  "d_kv_len": lay.d_kv_len, "p_slots": t(lay.p_slots, -1),
                  "p_index": t(lay.p_index, len(lay.p_slots), lay.chunk_len), "p_pack": t(lay.p_pack, -1),
                  "p_kv_len": lay.p_kv_len, "logits_index": t(lay.logits_index, -1)}
        with torch.inference_mode():
            greedy, logits = self.step_fn(self.weights, t(lay.ids, 1, n), None, ragged["token_slots"], None, 0,
                                          self.k_cache, self.v_cache, False, ragged)
        return self._choose(greedy, logits, [c.sampler for c in chunks])


class TorchBackend(Backend):
    stack = "PyTorch"
    name = "torch"
    title = "generated PyTorch"

    # Bump when the artifact's files or their meaning change, so older cache entries miss.
    artifact_format = "6"

    def toolchain(self) -> dict[str, str]:
        return {"torch": torch.__version__, "format": self.artifact_format}

    def check_available(self, dtype: str) -> None:
        if dtype not in TORCH_DTYPES:
            raise BackendUnavailable(f"the {self.name} backend has no dtype '{dtype}'")

    def compile(self, graph: Graph, ckpt: Checkpoint, dtype: str, cache_len: int, out: Path) -> None:
        graph = optimize(graph)
        prepared.check_against(graph, ckpt)
        (out / "model.py").write_text(emit(graph))
        write_prepared_weights(out / "weights.safetensors", graph, ckpt, dtype)
        write_artifact_info(out, graph, dtype, cache_len, linear_weights=prepared.linear_weights(graph))

    def load(self, artifact: Path, rows: int, device: str | None = None, pack_weights: bool = True) -> Session:
        device = device or default_device()
        info = json.loads((artifact / "artifact.json").read_text())
        module = import_generated(artifact / "model.py", "linnet_generated")
        weights = load_prepared_weights(artifact / "weights.safetensors", device)
        if device == "cpu" and pack_weights:
            pack_linear_weights(weights, info["linear_weights"])
        return TorchSession(module, weights, info, rows, device, self.name)
