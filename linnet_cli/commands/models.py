"""linnet models: the short names Linnet knows, their Hugging Face ids and families."""

from __future__ import annotations

from rich.markup import escape

from linnet_core.hub import is_cached
from linnet_core.models import MODEL_TYPES
from linnet_core.models.catalog import CATALOG

from ..options import JsonOpt, QuietOpt
from ..output import Sink, handle_errors


@handle_errors
def models_command(json: JsonOpt = False, quiet: QuietOpt = False) -> None:
    """Known short names (usable wherever a MODEL is asked for), each with its Hugging Face repo id,
    family, size and whether it is already in the local Hugging Face cache; then the architectures
    (config.json's model_type) any checkpoint of which runs."""
    from rich.table import Table

    sink = Sink(json, quiet)
    rows = [{"name": name, "repo": m.repo, "model_type": m.model_type, "parameters": m.parameters,
             "cached": is_cached(m.repo)} for name, m in CATALOG.items()]
    if json or quiet:
        sink.data("", {"models": rows, "architectures": sorted(MODEL_TYPES)})
        return
    table = Table(box=None, pad_edge=False)
    for col in ("name", "Hugging Face id", "family", "size", "local"):
        table.add_column(col, no_wrap=True)
    for r in rows:
        table.add_row(escape(r["name"]), escape(r["repo"]), r["model_type"], r["parameters"],
                      "[green]cached[/]" if r["cached"] else "[dim]not fetched[/]")
    sink.out.print(table)
    sink.out.print(f"\nAny checkpoint of these architectures (config.json's model_type) runs, "
                   f"as a folder, a repo id or a GGUF: {', '.join(sorted(MODEL_TYPES))}")
