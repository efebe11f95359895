"""Whether a session fits in this machine's memory, judged from the sizes before anything loads.

A session holds its prepared weights (each once: loaders release the mapped originals of what they
copy or pack), its KV cache, and about half a GiB of runtime. Where that exceeds 95% of what the kernel
says it can still give (MemAvailable), the load is refused in one line naming the sizes, instead of
the process being killed half way. LINNET_MEMORY_CHECK=0 skips the check.
"""

from __future__ import annotations

import os

from .dtypes import FORMATS
from .errors import BackendUnavailable
from .models import build_graph
from .models.spec import ModelSpec
from .quant import param_formats

GIB = 2**30
RUNTIME_BYTES = GIB // 2  # interpreter, libraries and scratch buffers, measured on the 191M model
HEADROOM = 0.95  # of MemAvailable: what else runs meanwhile, and the estimate's own error


def weight_bytes(spec: ModelSpec, dtype: str, copies_of_tied: int = 1) -> int:
    """Bytes of the prepared weights: every param once (a tied head once more when the layout
    stores it twice, as the ONNX one does)."""
    graph = build_graph(spec)
    formats = param_formats(graph, dtype)  # a quantized choice leaves norms (and odd sizes) wide
    total, seen = 0, set()
    for full, p, layer in graph.all_params():
        n = 1
        for d in p.shape:
            n *= d
        source = (tuple(p.sources(layer)), p.shape, formats[full], p.offset)
        if source in seen and copies_of_tied == 1:
            continue
        seen.add(source)
        total += FORMATS[formats[full]].nbytes(n)
    return total


def kv_cache_bytes(spec: ModelSpec, cache_dtype: str, cache_len: int, rows: int) -> int:
    """Bytes of a KV cache held in compute dtype `cache_dtype` (a backend's kv_cache_dtype)."""
    return FORMATS[cache_dtype].nbytes(spec.num_layers * 2 * rows * spec.num_kv_heads * cache_len * spec.head_dim)


def proc_kib(path: str, field: str) -> int | None:
    """A `Field:   N kB` line of a /proc file, in bytes; None where /proc or the field is not there."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def available_bytes() -> int | None:
    """What the kernel can still give without swapping (MemAvailable), None where unknown."""
    return proc_kib("/proc/meminfo", "MemAvailable")


def session_bytes(spec: ModelSpec, dtype: str, cache_dtype: str, cache_len: int, rows: int, weight_copies: float,
                  copies_of_tied: int = 1) -> int:
    return int(weight_bytes(spec, dtype, copies_of_tied) * weight_copies) \
        + kv_cache_bytes(spec, cache_dtype, cache_len, rows) + RUNTIME_BYTES


def check_fits(spec: ModelSpec, backend, dtype: str, cache_len: int, rows: int, device: str) -> None:
    """Raise BackendUnavailable, with the sizes, when a CPU session of `backend` cannot fit here."""
    if device != "cpu" or os.environ.get("LINNET_MEMORY_CHECK", "1") == "0":
        return
    free = available_bytes()
    if free is None:
        return
    copies = backend.weight_copies(dtype, device)
    kv = backend.kv_cache_dtype(dtype)
    need = session_bytes(spec, dtype, kv, cache_len, rows, copies, backend.copies_of_tied)
    if need > free * HEADROOM:
        weights = weight_bytes(spec, dtype, backend.copies_of_tied) * copies
        raise BackendUnavailable(
            f"{backend.title} in {dtype} needs about {need / GIB:.1f} GiB here ({weights / GIB:.1f} GiB of weights, "
            f"{kv_cache_bytes(spec, kv, cache_len, rows) / GIB:.1f} GiB of KV cache, "
            f"{RUNTIME_BYTES / GIB:.1f} GiB of runtime); this machine has {free / GIB:.1f} GiB available",
            hint="choose a smaller --dtype or --cache-len, another backend, or a machine with more memory "
                 "(LINNET_MEMORY_CHECK=0 skips this check)")
