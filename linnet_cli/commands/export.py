"""linnet export: folders for the runtimes people already run (one subcommand per format)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from ..options import CacheLenOpt, DtypeOpt, JsonOpt, ModelArg, QuietOpt, RevisionOpt
from ..output import Sink, handle_errors

export_app = typer.Typer(help="Export a model for another runtime.", no_args_is_help=True)
OutArg = Annotated[Path, typer.Argument(help="Folder to create (refused if it exists, unless --force).",
                                        show_default=False)]
ForceOpt = Annotated[bool, typer.Option("--force", help="Replace OUT if it exists.")]


def _size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _report(sink: Sink, result, extra: dict) -> None:
    lines = [escape(str(result.out))] + [f"  {name:<28} {_size(size):>10}" for name, size in result.files.items()]
    lines.append(f"[dim]{len(result.files)} files · {_size(result.total_bytes)} · {result.seconds:.1f} s[/]")
    sink.data("\n".join(lines), {"out": str(result.out), "files": result.files, "bytes": result.total_bytes,
                                 "seconds": round(result.seconds, 3), **extra})


@export_app.command("onnx")
@handle_errors
def export_onnx_command(
    model: ModelArg,
    out: OutArg,
    dtype: DtypeOpt = "float32",
    cache_len: CacheLenOpt = None,
    force: ForceOpt = False,
    revision: RevisionOpt = None,
    json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """The ONNX graph (prefill and batched decode over a static KV cache), its external weights,
    interface.json (entry points, input/output names, cache layout) and the tokenizer files."""
    # The core (and torch) load here, not at CLI start-up, so --help and completion stay fast.
    from linnet_core.export.onnx_export import export_onnx

    sink = Sink(json, quiet)
    sink.info(f"exporting {model} to ONNX ({dtype})...")
    result = export_onnx(model, out, dtype, cache_len, force, revision)
    _report(sink, result, {"format": "onnx", "dtype": dtype})
