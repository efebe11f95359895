"""Backends `inductor` and `cudagraphs`: the generated PyTorch module under `torch.compile`.

Static shapes: prompts are padded to power-of-two buckets and decode batches to power-of-two
row counts (padding rows write into one spare cache row), attention always spans the whole
cache, so each bucket compiles once, with `fullgraph=True` (a graph break is an error, not a
slowdown). On CPU the linear weights are packed for oneDNN (see cpu/linears.py) and the rest are frozen
into constants, so inductor fuses everything around the GEMVs.
Inductor's caches live in the artifact (`inductor_cache/`), filled for the first buckets at
compile time, so a second process loads compiled code instead of compiling it again.
`cudagraphs` adds CUDA graph capture of every bucket (mode "reduce-overhead") and needs a GPU.
"""

from __future__ import annotations

import os
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Sequence

import torch

from ..errors import BackendUnavailable
from ..runtime.session import Session
from .artifact import (
    MIN_PROMPT_BUCKET,
    WEIGHTS_FILE,
    bucket,
    import_generated,
    load_prepared_weights,
    read_info,
    warm_up,
)
from .cpu.linears import active as kernels_active
from .torch_backend import TorchBackend, TorchSession, check_quantized, session_weights

# Inductor reads its cache folder from the environment whenever it compiles; the variable is
# the process's, so each session sets it around its own calls, one session at a time.
_CACHE_DIR_LOCK = threading.RLock()


@contextmanager
def inductor_cache(folder: Path) -> Iterator[None]:
    """Inductor's on-disk caches (FX graph and kernels) in `folder` while the block runs."""
    with _CACHE_DIR_LOCK:
        previous = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)
        try:
            yield
        finally:
            if previous is None:
                os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
            else:
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = previous


def configure_inductor() -> None:
    import torch._inductor.config as inductor_config

    inductor_config.fx_graph_cache = True
    inductor_config.freezing = True
    allow_bucket_recompiles()


def allow_bucket_recompiles() -> None:
    """One compiled graph per bucket (log2 of the cache length prompt sizes, log2 of the rows) and
    per session: well past dynamo's default of 8 recompiles of one function. Dynamo's settings
    hold per thread, so a session driven from another thread (the serving engine's) sets them too."""
    import torch._dynamo.config as dynamo_config

    if dynamo_config.recompile_limit < 1024:
        dynamo_config.recompile_limit = 1024
        dynamo_config.accumulated_recompile_limit = max(dynamo_config.accumulated_recompile_limit, 4096)


class FrozenStep(torch.nn.Module):
    """The generated step with the tensor weights as module parameters, so inductor's freezing
    folds them into constants; linear weights packed for the CPU (PackedLinear) stay callables."""

    def __init__(self, step, weights: dict, cache_len: int):
        super().__init__()
        self.step, self.cache_len = step, cache_len
        self.names: list[tuple[int | None, str]] = []
        self.kernels: dict[int, object] = {}
        for layer, group in [(None, weights["global"])] + list(enumerate(weights["layers"])):
            for name, w in group.items():
                k = len(self.names)
                if isinstance(w, torch.Tensor):
                    self.register_parameter(f"w{k}", torch.nn.Parameter(w, requires_grad=False))
                else:
                    self.kernels[k] = w
                self.names.append((layer, name))
        self.layers = len(weights["layers"])

    def weights(self) -> dict:
        out: dict = {"global": {}, "layers": [{} for _ in range(self.layers)]}
        for k, (layer, name) in enumerate(self.names):
            group = out["global"] if layer is None else out["layers"][layer]
            group[name] = self.kernels[k] if k in self.kernels else getattr(self, f"w{k}")
        return out

    def forward(self, ids, start, slots, last, k_cache, v_cache, all_logits: bool = False):
        return self.step(self.weights(), ids, start, slots, last, self.cache_len, k_cache, v_cache, all_logits)


class CompiledTorchSession(TorchSession):
    """TorchSession over a compiled dense step: padded to buckets, one spare row for padding rows."""

    def __init__(self, module, weights, kernels: list, info: dict, rows: int, device: str, backend: str,
                 mode: str | None, cache_dir: Path):
        super().__init__(module, weights, info, rows + 1, device, backend, kernels)
        self.cache_dir = cache_dir
        self.rows = rows  # row `rows` is the spare one that padding rows write into
        # The caches are updated in place every step: a static address lets inductor write them
        # where they lie instead of through copies (and lets CUDA graphs replay over them).
        torch._dynamo.mark_static_address(self.k_cache)
        torch._dynamo.mark_static_address(self.v_cache)
        self.frozen = FrozenStep(module.step, weights, self.cache_len).eval()
        self.compiled = torch.compile(self.frozen, fullgraph=True, dynamic=False, mode=mode)
        self.compiled_buckets: set[tuple] = set()  # (rows, tokens, all logits) run once already

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
        allow_bucket_recompiles()
        key = (Bp, Tp, all_logits)
        # Once a bucket has compiled, only the guards that tell compiled buckets apart need to run:
        # the rest (every weight's) cost ~0.17 ms of a ~4.5 ms decode step at the 191M Qwen3's shape.
        stance = torch.compiler.set_stance(skip_guard_eval_unsafe=key in self.compiled_buckets)
        with torch.inference_mode(), kernels_active(self.kernels), inductor_cache(self.cache_dir), stance:
            next_token, logits = self.compiled(ids_p.to(dev), start_p.to(dev), slots_p.to(dev), last.to(dev),
                                               self.k_cache, self.v_cache, all_logits)
        self.compiled_buckets.add(key)
        return next_token[:B], (logits[:B, :T] if all_logits else logits[:B])


class InductorBackend(TorchBackend):
    name = "inductor"
    title = "inductor"
    ragged = False  # compiled per bucket of [B, T]: a mixed step runs as one call per chunk length
    artifact_format = "9"
    mode: str | None = None  # torch.compile mode
    loads_at_compile = True  # inductor compiles by running the step (freezing needs the weights)

    def toolchain(self) -> dict[str, str]:
        return {**super().toolchain(), "backend": self.name}

    def finish(self, out: Path) -> None:
        warm_up(self.load(out, rows=1))

    def load(self, artifact: Path, rows: int, device: str | None = None) -> Session:
        configure_inductor()
        info = read_info(artifact)
        device = device or self.default_device()
        self.check_device(device)
        check_quantized(info["dtype"], device)
        module = import_generated(artifact / "model.py", "linnet_inductor")
        weights = load_prepared_weights(artifact / WEIGHTS_FILE, device)
        kernels = session_weights(weights, info, device, eager=False)
        return CompiledTorchSession(module, weights, kernels, info, rows, device, self.name, self.mode,
                                    artifact / "inductor_cache")


class CudaGraphsBackend(InductorBackend):
    name = "cudagraphs"
    title = "CUDA graphs"
    mode = "reduce-overhead"  # inductor, then CUDA graph capture per static shape (bucket)

    def check_available(self, dtype: str) -> None:
        if not torch.cuda.is_available():
            raise BackendUnavailable("CUDA graphs need an NVIDIA GPU, and none is visible here",
                                     hint="use --backend inductor on this machine")
        super().check_available(dtype)

    def check_device(self, device: str) -> None:
        if device != "cuda":
            raise BackendUnavailable("CUDA graphs run on NVIDIA GPUs only", hint="use --backend inductor on the CPU")
        super().check_device(device)
