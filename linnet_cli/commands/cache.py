"""linnet cache: list, remove and prune compiled artifacts, and say where they live."""

from __future__ import annotations

import time
from typing import Annotated, Optional

import typer
from rich.markup import escape

from linnet_core.errors import InputError
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
    from linnet_core.cache import cache_root  # imports torch: not at start-up

    Sink(json, quiet).data(escape(str(cache_root())), {"path": str(cache_root())})


@cache_app.command("ls")
@handle_errors
def cache_ls(json: JsonOpt = False, quiet: QuietOpt = False) -> None:
    """Every artifact: model, backend, dtype, cache length, own size, age and last use (most recent first),
    then the stored weights they share, each once, with what uses them."""
    from linnet_core.cache import ArtifactCache  # imports torch: not at start-up

    cache = ArtifactCache()
    entries = cache.entries()
    blobs = cache.store.blobs()
    total = sum(e.size for e in entries) + sum(b.size for b in blobs)
    from rich.console import Group

    summary = (f"[dim]{len(entries)} entries · {len(blobs)} stored weights · {format_size(total)} · "
               f"{escape(str(cache.root))}[/]")
    parts = ([_table(entries)] if entries else []) + ([_weights_table(blobs, entries)] if blobs else [])
    human = Group(*parts, summary) if parts else summary
    Sink(json, quiet).data(human, {"root": str(cache.root), "bytes": total,
                                   "entries": [e.to_json() for e in entries],
                                   "shared_weights": [{**b.to_json(), "used_by": [e.path.name for e in entries
                                                                                 if b.path.name in e.shared]}
                                                      for b in blobs]})


def _weights_table(blobs, entries):
    """The stored weights, each once, with the entries that link them (their sizes are not in the entries')."""
    from rich.table import Table

    table = Table(box=None, pad_edge=False, title="stored weights (shared)", title_justify="left")
    for col, justify in (("weights", "left"), ("model", "left"), ("dtype", "left"), ("layout", "left"),
                         ("size", "right"), ("used by", "left")):
        table.add_column(col, justify=justify)
    for b in blobs:
        users = [e.path.name for e in entries if b.path.name in e.shared]
        table.add_row(escape(b.path.name), escape(str(b.meta.get("model", "?"))), str(b.meta.get("dtype", "?")),
                      str(b.meta.get("layout", "?")), format_size(b.size),
                      escape(", ".join(users)) if users else "[dim]nothing (removed by rm and prune)[/]")
    return table


def _matching(entries, patterns: list[str], backend: str | None, every: bool):
    if not (patterns or backend or every):
        raise InputError("say what to remove: entry names or models, --backend, or --all")
    if any(not p.strip() for p in patterns):  # "" starts every name: it must not mean "everything"
        raise InputError("an empty name matches nothing", hint="name entries or models, or say --all")
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
    """Remove entries (each under its locks: a build in progress is waited for, and an entry a running
    process is using is left in place, said in one line, exit status 1)."""
    from linnet_core.cache import ArtifactCache, EntryInUse  # imports torch: not at start-up

    cache = ArtifactCache()
    chosen = _matching(cache.entries(), names or [], backend, every)
    freed = cache.freed_with(chosen)
    in_use = []
    if not dry_run:
        chosen, in_use = cache.remove_all(chosen)
        freed = [b for b in freed if not b.path.exists()]
    _say_removed(json, quiet, dry_run, chosen, freed)
    if in_use:
        raise EntryInUse(f"{len(in_use)} entries are in use by running processes and were left in place: "
                         f"{', '.join(e.path.name for e in in_use)}")


def _say_removed(json: bool, quiet: bool, dry_run: bool, entries, freed) -> None:
    """One line: entries removed, and the stored weights that went with them (used by no other entry)."""
    verb = "would remove" if dry_run else "removed"
    size = sum(e.size for e in entries) + sum(b.size for b in freed)
    weights = f" and {len(freed)} stored weights no other entry uses" if freed else ""
    Sink(json, quiet).data(f"{verb} {len(entries)} entries{weights} ({format_size(size)})",
                           {"removed": [e.to_json() for e in entries], "removed_weights": [b.to_json() for b in freed],
                            "bytes": size, "dry_run": dry_run})


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
    from linnet_core.cache import ArtifactCache  # imports torch: not at start-up

    if older_than is None and max_size is None:
        raise InputError("say what to prune: --older-than, --max-size, or both")
    cache = ArtifactCache()
    chosen = cache.prune(parse_duration(older_than) if older_than else None,
                         parse_size(max_size) if max_size else None, dry_run=True)
    freed = cache.freed_with(chosen)
    in_use = []
    if not dry_run:  # exactly what was chosen above, so the line below says what happened
        chosen, in_use = cache.remove_all(chosen)
        cache.store.remove_unused()
        freed = [b for b in freed if not b.path.exists()]
    _say_removed(json, quiet, dry_run, chosen, freed)
    if in_use:  # not an error: a scheduled prune goes on around a running server
        Sink(json, quiet).info(f"left {len(in_use)} entries in use by running processes: "
                               f"{', '.join(e.path.name for e in in_use)}")
