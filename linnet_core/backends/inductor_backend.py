"""Backends `inductor` and `cudagraphs`: the generated PyTorch module under `torch.compile`.

Static shapes: prompts are padded to power-of-two buckets and decode batches to power-of-two
row counts (padding rows write into one spare cache row), attention always spans the whole
cache, so each bucket compiles once, with `fullgraph=True` (a graph break is an error, not a
slowdown). The weights are closed over and frozen, so inductor folds and pre-packs them.
Inductor's caches live in the artifact (`inductor_cache/`), filled for the first buckets at
compile time, so a second process loads compiled code instead of compiling it again.
`cudagraphs` adds CUDA graph capture of every bucket (mode "reduce-overhead") and needs a GPU.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Sequence

import torch

from ..errors import BackendUnavailable
from ..ir.graph import Graph
from ..runtime.session import Session
from ..weights import Checkpoint
from .jax_backend import MIN_PROMPT_BUCKET, bucket, warm_up
from .torch_backend import TorchBackend, TorchSession, import_generated, load_prepared_weights


def use_inductor_cache(folder: Path) -> None:
    """Point inductor's on-disk caches (FX graph and kernels) at `folder`; read when compiling."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)
    import torch._inductor.config as inductor_config

    inductor_config.fx_graph_cache = True
    inductor_config.freezing = True
    import torch._dynamo.config as dynamo_config

    # One compiled graph per bucket (log2 of the cache length prompt sizes, log2 of the rows) and
    # per session: well past dynamo's default of 8 recompiles of one function.
    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 1024)
    dynamo_config.accumulated_recompile_limit = max(dynamo_config.accumulated_recompile_limit, 4096)


class CompiledTorchSession(TorchSession):
    """TorchSession over a compiled step: padded to buckets, one spare row for padding rows."""

    def __init__(self, module, weights, info: dict, rows: int, device: str, backend: str, mode: str | None):
        super().__init__(module, weights, info, rows + 1, device, backend)
        self.rows = rows  # row `rows` is the spare one that padding rows write into
        step, cache_len = module.step, self.cache_len

        def frozen_step(ids, start, slots, last, k_cache, v_cache, all_logits: bool = False):
            return step(weights, ids, start, slots, last, cache_len, k_cache, v_cache, all_logits)

        self.compiled = torch.compile(frozen_step, fullgraph=True, dynamic=False, mode=mode)

    def _run(self, ids: Sequence[Sequence[int]], start: Sequence[int], slots: Sequence[int], all_logits: bool):
        B, T = len(ids), len(ids[0])
        Bp = bucket(B, 1, self.rows)
        Tp = T if T == 1 else bucket(T, MIN_PROMPT_BUCKET, self.cache_len - max(start))
        dev = self.device
        ids_p = torch.zeros((Bp, Tp), dtype=torch.int64)  # [Bp, Tp]
        ids_p[:B, :T] = torch.tensor(ids)
        start_p = torch.zeros(Bp, dtype=torch.int64)
        start_p[:B] = torch.tensor(start)
        slots_p = torch.full((Bp,), self.rows, dtype=torch.int64)  # padding rows -> the spare row
        slots_p[:B] = torch.tensor(slots)
        last = torch.full((Bp,), T - 1, dtype=torch.int64)
        with torch.inference_mode():
            next_token, logits = self.compiled(ids_p.to(dev), start_p.to(dev), slots_p.to(dev), last.to(dev),
                                               self.k_cache, self.v_cache, all_logits)
        if all_logits:  # the greedy token of a padded prompt is at `last`, not at the bucket's end
            next_token = logits[torch.arange(Bp, device=dev), last.to(dev)].argmax(-1)
            logits = logits[:B, :T]
        return next_token[:B], logits[:B]


class InductorBackend(TorchBackend):
    name = "inductor"
    title = "inductor"
    artifact_format = "1"
    mode: str | None = None  # torch.compile mode

    def toolchain(self) -> dict[str, str]:
        return {**super().toolchain(), "backend": self.name, "format": self.artifact_format}

    def compile(self, graph: Graph, ckpt: Checkpoint, dtype: str, cache_len: int, out: Path) -> None:
        super().compile(graph, ckpt, dtype, cache_len, out)
        warm_up(self.load(out, rows=1))

    def load(self, artifact: Path, rows: int, device: str | None = None, pack_weights: bool = False) -> Session:
        use_inductor_cache(artifact / "inductor_cache")
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        info = json.loads((artifact / "artifact.json").read_text())
        module = import_generated(artifact / "model.py", "linnet_inductor")
        weights = load_prepared_weights(artifact / "weights.safetensors", device)
        return CompiledTorchSession(module, weights, info, rows, device, self.name, self.mode)


class CudaGraphsBackend(InductorBackend):
    name = "cudagraphs"
    title = "CUDA graphs"
    mode = "reduce-overhead"  # inductor, then CUDA graph capture per static shape (bucket)

    def check_available(self, dtype: str) -> None:
        if not torch.cuda.is_available():
            raise BackendUnavailable("CUDA graphs need an NVIDIA GPU, and none is visible here",
                                     hint="use --backend inductor on this machine")
        super().check_available(dtype)
