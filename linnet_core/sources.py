"""Digests of Linnet's own sources, in the cache keys: a change to code that writes artifacts or
prepares weights can never reuse what the old code made (a version bump is easy to forget)."""

from __future__ import annotations

import hashlib
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent
# What prepares stored weights: the quantizer, the GGUF reader (un-permuted rows, dequantized
# K-quants), the families' weight roles and layouts, the prepared-parameter layout, the writer.
WEIGHT_SOURCES = ("gguf", "models", "params.py", "quant.py", "dtypes.py", "weights.py")
# What shapes an artifact's files: the above, the IR and the emitters.
ARTIFACT_SOURCES = ("ir", "backends", *WEIGHT_SOURCES)


def digest(entries: tuple[str, ...], root: Path = ROOT) -> str:
    """sha256 over the Python and C++ sources under `entries` (files or folders of `root`)."""
    h = hashlib.sha256()
    for entry in entries:
        path = root / entry
        if not path.exists():
            raise FileNotFoundError(f"{path}: a source named in the cache key is missing")
        for f in sorted(path.rglob("*") if path.is_dir() else [path]):
            if f.suffix in (".py", ".cpp", ".h") and "__pycache__" not in f.parts:
                h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:16]


@lru_cache(maxsize=1)
def artifact_sources_digest() -> str:
    return digest(ARTIFACT_SOURCES)


@lru_cache(maxsize=1)
def weight_sources_digest() -> str:
    return digest(WEIGHT_SOURCES)
