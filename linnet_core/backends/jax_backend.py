"""Backend `jax` ("XLA (generated JAX)"): the emitted JAX module under `jax.jit`.

Static shapes: a prompt is padded to a power-of-two bucket and a decode batch to a power-of-two
number of rows (padding rows point past the cache, so their writes are dropped), giving one
compiled executable per bucket. The KV cache is donated to every step and comes back updated in
place. JAX's persistent compilation cache lives in the artifact (`xla_cache/`), filled for the
first buckets at compile time, so a warm load does not compile them again.
"""

from __future__ import annotations

import functools
import os
import pkgutil
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from ..dtypes import FORMATS, compute_dtype, numpy_dtype
from ..errors import BackendUnavailable
from ..ir.graph import Graph
from ..quant import BLOCK, nbits_layout, nbits_shapes
from ..runtime.sampling import Sampler
from ..runtime.session import Session
from .artifact import (
    MIN_PROMPT_BUCKET,
    WEIGHTS_FILE,
    bucket,
    import_generated,
    load_prepared_weights,
    prepared_shapes,
    read_info,
    warm_up_shapes,
)
from .base import Backend
from .jax_emit import emit

INSTALL_HINT = "pip install 'linnet[jax]'"
CUDA_HINT = "pip install 'jax[cuda13]' (or cuda12, matching the driver)"


def import_jax():
    # JAX would otherwise take 75% of a GPU's memory up front, leaving none to other sessions
    # (a bench's other sides, a second backend in the same server).
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    try:
        import jax
    except ImportError:
        raise BackendUnavailable("JAX is not installed", hint=INSTALL_HINT) from None
    return jax


def use_compilation_cache(folder: Path) -> None:
    """Point JAX's persistent compilation cache at `folder` (it is process-wide in JAX)."""
    jax = import_jax()
    from jax.experimental.compilation_cache import compilation_cache

    if jax.config.jax_compilation_cache_dir != str(folder):
        compilation_cache.reset_cache()
        jax.config.update("jax_compilation_cache_dir", str(folder))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
        # The cache key must not depend on where the artifact lies (it is built in a temporary
        # folder, then renamed) nor on who called: no cache paths in the compile options, no
        # caller's stack in the module's locations.
        jax.config.update("jax_persistent_cache_enable_xla_caches", "none")
        jax.config.update("jax_include_full_tracebacks_in_locations", False)


def release_compilation_cache() -> None:
    """Stop JAX writing to the folder set by `use_compilation_cache` (until it is set again)."""
    jax = import_jax()
    from jax.experimental.compilation_cache import compilation_cache

    compilation_cache.reset_cache()
    jax.config.update("jax_compilation_cache_dir", None)


def has_cuda_plugin() -> bool:
    """Whether this JAX has a CUDA plugin, found without starting JAX (which would claim the GPU)."""
    return any(m.name.startswith("jax_cuda") for m in pkgutil.iter_modules())


def jax_device(device: str | None):
    """The JAX device a session runs on: `device` ("cpu", "cuda") or JAX's default."""
    jax = import_jax()
    if device is None:
        return jax.devices()[0]
    if device == "cpu":
        return jax.devices("cpu")[0]
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if not gpus:
        raise BackendUnavailable("this JAX sees no CUDA device", hint=CUDA_HINT)
    return gpus[0]


def to_jax(t: torch.Tensor, device=None):
    """A host tensor as an array on `device`; bfloat16 goes through its bits (numpy has no bfloat16)."""
    import jax
    import ml_dtypes

    host = t.view(torch.int16).numpy().view(ml_dtypes.bfloat16) if t.dtype == torch.bfloat16 else t.numpy()
    # A copy XLA owns, aligned as it wants: given the mapped file itself, XLA's CPU client copies
    # every weight again at the first call, doubling the session's peak memory.
    return jax.device_put(host.copy(), device)


def xla_weight(t: torch.Tensor, fmt: str | None, device=None):
    """A prepared weight as the XLA graphs take it: an array, or for GGUF blocks of `fmt` the pair
    (values, scales) of quant.nbits_layout, which the graph dequantizes (the same numbers)."""
    if fmt is None:
        return to_jax(t, device)
    values, scales = nbits_layout(t, fmt)
    return to_jax(values, device), to_jax(scales, device)


# XLA's CPU compiler runs 16-bit matmuls as scalar loops: a 2560x9728 GEMV takes 59 ms in bfloat16
# and 52 ms in float16 against 3.9 ms in float32 (jax 0.10, measured; converting to float32 first or
# a multiply-and-reduce is no faster), a 20th of what inductor streams. Tests of the emitters' 16-bit
# math on a CPU turn this off; a user is pointed to the backends that run those dtypes fast.
REFUSE_HALF_ON_CPU = True


def check_half_on_cpu(backend: str, dtype: str, platform: str) -> None:
    """Refuse 16-bit on a CPU (`platform`: a JAX device platform or a Linnet device name), in one line."""
    if REFUSE_HALF_ON_CPU and platform == "cpu" and compute_dtype(dtype) in ("bfloat16", "float16"):
        raise BackendUnavailable(
            f"XLA's CPU compiler runs {dtype} matmuls about 15x slower than float32, so {backend} offers "
            f"{dtype} on GPUs only", hint=f"--backend inductor (or torch) runs {dtype} on this CPU; "
                                          f"--dtype float32 or q8_0 / q4_0 on {backend}")


@functools.lru_cache(maxsize=1)
def _row_copier():
    import jax
    from jax import lax

    def copy(k, v, src, dst):  # [layers, rows, kv_heads, cache_len, head_dim] each
        return tuple(lax.dynamic_update_index_in_dim(c, lax.dynamic_index_in_dim(c, src, axis=1), dst, axis=1)
                     for c in (k, v))

    return jax.jit(copy, donate_argnums=(0, 1))


def _copy_row(k, v, src: int, dst: int):
    return _row_copier()(k, v, src, dst)


class XlaSession(Session):
    """Shared by the XLA backends: buckets, padding, the donated cache; `fn` is one compiled step."""

    def __init__(self, info: dict, rows: int, backend: str, device):
        import jax.numpy as jnp

        self.backend, self.rows, self.device = backend, rows, device
        self.dtype, self.cache_len, self.vocab_size = info["dtype"], info["cache_len"], info["vocab_size"]
        c = info["cache"]
        shape = (c["layers"], rows, c["kv_heads"], self.cache_len, c["head_dim"])
        self.k_cache = jnp.zeros(shape, dtype=numpy_dtype(self.dtype), device=device)
        self.v_cache = jnp.zeros(shape, dtype=numpy_dtype(self.dtype), device=device)

    def _copy_rows(self, src: int, dst: int, n: int) -> None:
        # The whole row, so one compiled copy serves every prefix length: positions past n are
        # written again before they are read.
        self.k_cache, self.v_cache = _copy_row(self.k_cache, self.v_cache, src, dst)

    def _device_step(self, ids, start, slots, last, all_logits: bool):
        """Run one padded step; returns (next_token, logits) device arrays, caches updated."""
        raise NotImplementedError

    def precompile(self, B: int, T: int, all_logits: bool = False) -> None:
        """Compile the padded [B, T] step without running it (the weights may be shapes only), into
        the artifact's caches."""
        raise NotImplementedError

    def _run(self, ids: Sequence[Sequence[int]], start: Sequence[int], slots: Sequence[int], all_logits: bool):
        B, T = len(ids), len(ids[0])
        Bp = bucket(B, 1, self.rows)
        Tp = T if T == 1 else bucket(T, MIN_PROMPT_BUCKET, self.cache_len)
        ids_p = np.zeros((Bp, Tp), dtype=np.int32)  # [Bp, Tp]
        ids_p[:B, :T] = ids
        start_p = np.zeros(Bp, dtype=np.int32)
        start_p[:B] = start
        slots_p = np.full(Bp, self.rows, dtype=np.int32)  # padding rows point past the cache
        slots_p[:B] = slots
        last = np.full(Bp, T - 1, dtype=np.int32)
        next_token, logits = self._device_step(ids_p, start_p, slots_p, last, all_logits)
        return next_token[:B], (logits[:B, :T] if all_logits else logits[:B])

    def _to_host(self, array: Any) -> np.ndarray:
        a = np.asarray(array)
        return a if a.dtype.kind in "iu" else a.astype(np.float32)  # float16 and bfloat16 too

    def _sample(self, logits: Any, row: int, sampler: Sampler) -> int:
        return sampler.pick(torch.from_numpy(np.array(logits[row, -1], dtype=np.float32)))  # a writable copy

    def _logit_rows(self, logits: Any, rows: Sequence[int]) -> Any:
        return torch.from_numpy(np.array(logits[np.asarray(rows), -1], dtype=np.float32))

    def _concat(self, parts: list[Any]) -> Any:
        return np.concatenate([np.asarray(p) for p in parts])


class JaxSession(XlaSession):
    def __init__(self, module, weights: dict, info: dict, rows: int, backend: str, device):
        import jax

        super().__init__(info, rows, backend, device)
        self.weights = weights
        self._step = jax.jit(module.step, static_argnames=("all_logits",), donate_argnums=(1, 2))

    def _device_step(self, ids, start, slots, last, all_logits: bool):
        next_token, logits, self.k_cache, self.v_cache = self._step(
            self.weights, self.k_cache, self.v_cache, ids, start, slots, last, all_logits=all_logits)
        return next_token, logits

    def precompile(self, B: int, T: int, all_logits: bool = False) -> None:
        rows = np.zeros(B, dtype=np.int32)
        ids = np.zeros((B, T), dtype=np.int32)
        self._step.lower(self.weights, self.k_cache, self.v_cache, ids, rows, rows, rows,
                         all_logits=all_logits).compile()


class XlaBackend(Backend):
    """What the two XLA backends share: JAX as the toolchain (its version and platform key the cache)."""

    stack = "JAX"
    artifact_format = "3"

    def toolchain(self) -> dict[str, str]:
        jax = import_jax()
        return {"jax": jax.__version__, "platform": jax.default_backend()}

    def check_available(self, dtype: str) -> None:
        import_jax()
        check_half_on_cpu(self.name, dtype, self.default_device())

    def weight_copies(self, dtype: str, device: str) -> float:
        # XLA's CPU compiler runs half-precision dots in float32, converting the weights at every
        # call: a bfloat16 session peaks at over three times its weights (3.1x measured on a ~280M
        # model; the StableHLO side of Phi-3-mini was killed by the kernel at 3.0x's estimate).
        return 3.3 if device == "cpu" and dtype in ("bfloat16", "float16") else 1.0

    def check_device(self, device: str) -> None:
        super().check_device(device)
        if device == "cuda" and not has_cuda_plugin():
            raise BackendUnavailable("this JAX has no CUDA plugin", hint=CUDA_HINT)


class JaxBackend(XlaBackend):
    name = "jax"
    title = "XLA (generated JAX)"

    def emit(self, graph: Graph, dtype: str, cache_len: int, out: Path) -> None:
        (out / "model_jax.py").write_text(emit(graph))

    def finish(self, out: Path) -> None:
        # Compiled from the weights' shapes alone, so a compile never holds the model in memory;
        # a session's first calls then find these executables in the persistent cache.
        import jax

        use_compilation_cache(out / "xla_cache")
        dev = jax_device(None)
        np_dtype = numpy_dtype(read_info(out)["dtype"])
        shapes = prepared_shapes(out / WEIGHTS_FILE)
        sharding = jax.sharding.SingleDeviceSharding(dev)

        def struct(shape, fmt):  # what xla_weight makes of a weight, as shapes
            if fmt is None:
                return jax.ShapeDtypeStruct(shape, np_dtype, sharding=sharding)
            values, scales = nbits_shapes(shape[0], shape[1] // FORMATS[fmt].block_bytes * BLOCK, fmt)
            return (jax.ShapeDtypeStruct(values, np.uint8, sharding=sharding),
                    jax.ShapeDtypeStruct(scales, np.float32, sharding=sharding))

        weights = {"global": {k: struct(s, f) for k, (s, _, f) in shapes["global"].items()},
                   "layers": [{k: struct(s, f) for k, (s, _, f) in layer.items()} for layer in shapes["layers"]]}
        module = import_generated(out / "model_jax.py", "linnet_jax")
        session = JaxSession(module, weights, read_info(out), 1, self.name, dev)
        for B, T in warm_up_shapes(session.cache_len):
            session.precompile(B, T)
        release_compilation_cache()  # `out` is about to be renamed: JAX must not keep writing there

    def load(self, artifact: Path, rows: int, device: str | None = None) -> Session:
        use_compilation_cache(artifact / "xla_cache")
        info = read_info(artifact)
        module = import_generated(artifact / "model_jax.py", "linnet_jax")
        dev = jax_device(device)
        check_half_on_cpu(self.name, info["dtype"], dev.platform)
        host = load_prepared_weights(artifact / WEIGHTS_FILE, "cpu")

        def moved(name: str, t: torch.Tensor):
            array = xla_weight(t, host.format_of(name), dev)
            host.release(name)  # XLA holds its own copy now
            return array

        weights = {"global": {k: moved(k, v) for k, v in host["global"].items()},
                   "layers": [{k: moved(f"blk.{i}.{k}", v) for k, v in layer.items()}
                              for i, layer in enumerate(host["layers"])]}
        return JaxSession(module, weights, info, rows, self.name, dev)
