"""compile_model / load_model: checkpoint -> spec -> IR -> backend artifact (cached) -> session."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .backends import get_backend
from .cache import ArtifactCache, ArtifactKey, Lease, model_identity
from .dtypes import FORMATS, normalize_format
from .errors import BackendUnavailable, InputError
from .gguf.checkpoint import KEPT, GgufCheckpoint, read_gguf_config
from .hub import ResolvedModel, resolve
from .memory import check_fits
from .models import build_graph, read_config, spec_from_config
from .models.spec import ModelSpec
from .runtime.session import Session
from .weights import Checkpoint, checkpoint_files

DEFAULT_CACHE_LEN = 2048
DTYPE_CHOICES = ("auto",) + tuple(FORMATS)


@dataclass(frozen=True)
class Model:
    """A resolved checkpoint with its spec, ready to compile."""

    resolved: ResolvedModel
    config: dict
    spec: ModelSpec
    files: tuple[Path, ...]

    @property
    def path(self) -> Path:
        return self.resolved.path

    @property
    def is_gguf(self) -> bool:
        return self.path.is_file()

    def checkpoint(self) -> Checkpoint:
        """Its tensors, mapped lazily, under the family's Hugging Face names (a GGUF's too)."""
        if self.is_gguf:
            return GgufCheckpoint(self.path, self.spec)
        return Checkpoint(self.files)


@dataclass(frozen=True)
class Compiled:
    model: Model
    backend: str
    dtype: str
    cache_len: int
    artifact: Path
    hit: bool
    seconds: float
    lease: Lease | None = field(default=None, repr=False, compare=False)  # keeps `cache rm` off the artifact


def open_model(model: str | Path | None, revision: str | None = None) -> Model:
    resolved = resolve(model, revision)
    if resolved.path.is_file():  # a GGUF: the config its metadata describes, the file its only one

        config, parsed = read_gguf_config(resolved.path)
        parsed.close()
        return Model(resolved, config, spec_from_config(config), (resolved.path,))
    config = read_config(resolved.path)
    spec = spec_from_config(config)
    files = tuple(checkpoint_files(resolved.path))
    return Model(resolved, config, spec, files)


def pick_dtype(dtype: str, spec: ModelSpec) -> str:
    """`auto` is the checkpoint's own dtype; other spellings (bf16, fp16, q4, ...) are normalised.
    A block-quantized choice (q8_0, q4_0) is the weights' storage; they compute in float32."""
    if dtype == "auto":
        return spec.dtype
    canonical = normalize_format(dtype)
    if canonical is None:
        raise InputError(f"unknown dtype '{dtype}' (choose from: {', '.join(DTYPE_CHOICES)})")
    return canonical


def pick_cache_len(cache_len: int | None, spec: ModelSpec) -> int:
    if cache_len is None:
        return min(DEFAULT_CACHE_LEN, spec.max_position_embeddings)
    if cache_len < 1:
        raise InputError(f"--cache-len must be at least 1, got {cache_len}")
    return cache_len


def compile_model(model: str | Path | Model | None, backend: str = "torch", dtype: str = "auto",
                  cache_len: int | None = None, *, revision: str | None = None,
                  cache: ArtifactCache | None = None, progress: Callable[[str], None] | None = None) -> Compiled:
    """Compile (or find in the cache) the artifact of `model` for `backend` and `dtype`.

    `progress` hears one line when a build starts (a cache hit says nothing).
    """
    t0 = time.perf_counter()
    m = model if isinstance(model, Model) else open_model(model, revision)
    be = get_backend(backend)
    dt = pick_dtype(dtype, m.spec)
    be.check_format(dt)
    try:
        be.check_available(dt)
    except BackendUnavailable:
        if dtype != "auto" or dt == "float32":
            raise
        # `auto` asked for no dtype in particular: float32 runs where the checkpoint's does not.
        if progress:
            progress(f"{be.name} cannot run {dt} here; --dtype auto picks float32")
        dt = "float32"
        be.check_available(dt)
    n = pick_cache_len(cache_len, m.spec)
    key = ArtifactKey(
        model=m.resolved.repo_id or m.resolved.name,
        identity=model_identity(m.config, list(m.files)),
        backend=be.name,
        dtype=dt,
        cache_len=n,
        toolchain=tuple(sorted(be.cache_toolchain().items())),
    )

    cache = cache or ArtifactCache()

    def build(out: Path) -> None:
        if be.loads_at_compile:  # its warm-up runs a session: refuse now, from the sizes, if it cannot fit
            check_fits(m.spec, be, dt, n, 1, be.default_device())
        if progress:
            progress(f"compiling {key.model} for {be.name} ({dt}, cache {n}); later runs load it from the cache")
            stored = m.config.get("gguf_weights")
            if stored:
                if KEPT.get(stored) != dt:
                    own = f" (its own format: --dtype {KEPT[stored]})" if stored in KEPT else ""
                    progress(f"the GGUF's {stored} weights are converted to {dt}{own}")
        ckpt = m.checkpoint()
        be.compile(build_graph(m.spec), ckpt, dt, n, out, place=cache.placer(key))

    entry = cache.get_or_build(key, build, meta={"source": str(m.path), "model_type": m.spec.model_type})
    if entry.fetched and progress:
        progress(f"{key.model} for {be.name} ({dt}) came compiled from the artifact store {cache.shared.url}")
    return Compiled(m, be.name, dt, n, entry.path, entry.hit, time.perf_counter() - t0, entry.lease)


def load_model(model: str | Path | Model | None, backend: str = "torch", dtype: str = "auto",
               cache_len: int | None = None, rows: int = 1, *, revision: str | None = None,
               cache: ArtifactCache | None = None, device: str | None = None,
               progress: Callable[[str], None] | None = None) -> tuple[Session, Compiled]:
    """Compile if needed, then load a session with `rows` cache rows."""
    if rows < 1:
        raise InputError(f"rows must be at least 1, got {rows}")
    compiled = compile_model(model, backend, dtype, cache_len, revision=revision, cache=cache, progress=progress)
    be = get_backend(compiled.backend)
    check_fits(compiled.model.spec, be, compiled.dtype, compiled.cache_len, rows, device or be.default_device())
    session = be.load(compiled.artifact, rows, device)
    session.cache_lease = compiled.lease  # held as long as the session is: its files stay while it may read them
    return session, compiled
