"""linnet compile: build (or find in the cache) a model's artifact for one backend and dtype."""

from __future__ import annotations

from rich.markup import escape

from linnet_core.models import build_graph

from ..options import BackendName, BackendOpt, CacheLenOpt, DtypeOpt, JsonOpt, ModelArg, QuietOpt, RevisionOpt
from ..output import Sink, handle_errors


@handle_errors
def compile_command(
    model: ModelArg,
    backend: BackendOpt = BackendName.torch,
    dtype: DtypeOpt = "auto",
    cache_len: CacheLenOpt = None,
    revision: RevisionOpt = None,
    json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Compile MODEL for a backend; prints the artifact path, whether it was cached, and the time."""
    # The core (and torch) load here, not at CLI start-up, so --help and completion stay fast.
    from linnet_core.compile import compile_model  # imports torch: not at start-up

    sink = Sink(json, quiet)
    c = compile_model(model, backend.value, dtype, cache_len, revision=revision, progress=sink.info)
    state = "cache hit" if c.hit else "compiled"
    from linnet_core.quant import summary  # imports torch: not at start-up

    stored = summary(build_graph(c.model.spec), c.dtype)
    if stored:
        sink.info(stored)
    sink.data(
        f"{escape(str(c.artifact))}\n[dim]{state} · {c.backend} · {c.dtype} · cache {c.cache_len} · {c.seconds:.2f} s[/]",
        {"artifact": str(c.artifact), "hit": c.hit, "seconds": round(c.seconds, 4), "backend": c.backend,
         "dtype": c.dtype, "cache_len": c.cache_len, "model": c.model.resolved.name,
         "model_type": c.model.spec.model_type},
    )
