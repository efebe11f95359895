"""`linnet export onnx`: the ONNX graph, its external weights, the interface JSON and the tokenizer."""

from __future__ import annotations

import time
from pathlib import Path

from ..backends.onnx_emit import emit_onnx, require_onnx
from ..compile import Model, open_model, pick_cache_len, pick_dtype
from ..ir.passes import optimize
from ..models import build_graph
from . import ExportResult, copy_tokenizer, output_folder, summarize


def export_onnx(model: str | Path | Model | None, out: Path, dtype: str = "float32", cache_len: int | None = None,
                force: bool = False, revision: str | None = None) -> ExportResult:
    started = time.perf_counter()
    m = model if isinstance(model, Model) else open_model(model, revision)
    dt = pick_dtype(dtype, m.spec)
    require_onnx()  # the onnx package is needed; ONNX Runtime is not
    n = pick_cache_len(cache_len, m.spec)
    with output_folder(Path(out), force) as tmp:
        emit_onnx(optimize(build_graph(m.spec)), m.checkpoint(), dt, n, tmp)
        copy_tokenizer(m.path, tmp)
    return summarize(Path(out), started)
