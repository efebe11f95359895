"""linnet cache: list, remove and prune compiled artifacts, and say where they live."""

from __future__ import annotations

import time
from typing import Annotated, Optional

import typer
from rich.markup import escape

from linnet_core.units import format_age, format_size, parse_duration, parse_size

from ..options import JsonOpt, QuietOpt
from ..output import Sink, handle_errors

cache_app = typer.Typer(help="List, remove and prune compiled artifacts.", no_args_is_help=True)
def _table(entries):
    from rich.table import Table

    table = Table(box=None, pad_edge=False)
    for col, justify in (("entry", "left"), ("model", "left"), ("backend", "left"), ("dtype", "left"),
                         ("cache len", "right"), ("size", "right"), ("created", "right"), ("last used", "right")):
        table.add_column(col, justify=justify, no_wrap=col != "model")
    now = time.time()
    for e in entries:
        table.add_row(escape(e.path.name), escape(e.model), e.backend, e.dtype, str(e.cache_len or "?"),
                      format_size(e.size), format_age(now - e.created), format_age(now - e.last_used),
                      style="" if e.intact else "red")
    return table


@cache_app.command("path")
@handle_errors
def cache_path(json: JsonOpt = False, quiet: QuietOpt = False) -> None:
    """Print the cache folder ($LINNET_CACHE, else $XDG_CACHE_HOME/linnet)."""
    from linnet_core.cache import cache_root

    Sink(json, quiet).data(escape(str(cache_root())), {"path": str(cache_root())})


@cache_app.command("ls")
@handle_errors
def cache_ls(json: JsonOpt = False, quiet: QuietOpt = False) -> None:
    """Every artifact: model, backend, dtype, cache length, size, age and last use (most recent first)."""
    from linnet_core.cache import ArtifactCache

    cache = ArtifactCache()
    entries = cache.entries()
    total = sum(e.size for e in entries)
    from rich.console import Group

    summary = f"[dim]{len(entries)} entries · {format_size(total)} · {escape(str(cache.root))}[/]"
    human = Group(_table(entries), summary) if entries else summary
    Sink(json, quiet).data(human, {"root": str(cache.root), "bytes": total,
                                   "entries": [e.to_json() for e in entries]})


def _matching(entries, patterns: list[str], backend: str | None, every: bool):
    from linnet_core.errors import InputError

    if not (patterns or backend or every):
        raise InputError("say what to remove: entry names or models, --backend, or --all")
    chosen = []
    for e in entries:
        model_names = (e.model, e.model.rstrip("/").split("/")[-1])
        named = not patterns or any(p in model_names or e.path.name.startswith(p) for p in patterns)
        if named and (backend is None or e.backend == backend):
            chosen.append(e)
    if patterns and not chosen:
        raise InputError(f"no cache entry matches {', '.join(patterns)}", hint="see `linnet cache ls`")
    return chosen


@cache_app.command("rm")
@handle_errors
def cache_rm(
    names: Annotated[Optional[list[str]], typer.Argument(help="Entry names (or their start) or model names.",
                                                         show_default=False)] = None,
    backend: Annotated[Optional[str], typer.Option("--backend", "-b", help="Only this backend's entries.")] = None,
    every: Annotated[bool, typer.Option("--all", help="Every entry.")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Say what would go; remove nothing.")] = False,
    json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Remove entries (each under its lock, so a build or load in progress is never cut short)."""
    from linnet_core.cache import ArtifactCache

    cache = ArtifactCache()
    chosen = _matching(cache.entries(), names or [], backend, every)
    if not dry_run:
        for e in chosen:
            cache.remove(e)
    verb = "would remove" if dry_run else "removed"
    Sink(json, quiet).data(f"{verb} {len(chosen)} entries ({format_size(sum(e.size for e in chosen))})",
                           {"removed": [e.to_json() for e in chosen], "dry_run": dry_run})


@cache_app.command("prune")
@handle_errors
def cache_prune(
    older_than: Annotated[Optional[str], typer.Option("--older-than", help="Remove entries unused this long "
                                                      "(30d, 12h, 90m, 2w).")] = None,
    max_size: Annotated[Optional[str], typer.Option("--max-size", help="Then remove the least recently used "
                                                    "until the cache fits (20GB, 500MB).")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Say what would go; remove nothing.")] = False,
    json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Remove stale entries; damaged ones always go."""
    from linnet_core.cache import ArtifactCache
    from linnet_core.errors import InputError

    if older_than is None and max_size is None:
        raise InputError("say what to prune: --older-than, --max-size, or both")
    gone = ArtifactCache().prune(parse_duration(older_than) if older_than else None,
                                 parse_size(max_size) if max_size else None, dry_run)
    verb = "would remove" if dry_run else "removed"
    Sink(json, quiet).data(f"{verb} {len(gone)} entries ({format_size(sum(e.size for e in gone))})",
                           {"removed": [e.to_json() for e in gone], "dry_run": dry_run})
