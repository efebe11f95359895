"""One output sink for every command: data to stdout (human or --json), the rest to stderr.

Errors from linnet_core become one line plus a hint and an exit code; a traceback is shown only
with LINNET_DEBUG=1.
"""

from __future__ import annotations

import errno
import functools
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any, Callable

import typer
from rich.console import Console
from rich.markup import escape

from linnet_core.errors import InputError, LinnetError

EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_CHECK_FAILED, EXIT_INTERRUPTED = 0, 1, 2, 3, 130


def _no_color() -> bool:
    return "NO_COLOR" in os.environ


class Sink:
    def __init__(self, json_mode: bool = False, quiet: bool = False):
        self.json_mode, self.quiet = json_mode, quiet
        # Piped into a log, Rich would squeeze tables into 80 columns: give them room instead.
        self.out = Console(file=sys.stdout, no_color=_no_color(), highlight=False, soft_wrap=True,
                           width=None if sys.stdout.isatty() else 200)
        self.err = Console(file=sys.stderr, no_color=_no_color(), highlight=False, soft_wrap=True)

    def data(self, human: Any, payload: dict[str, Any]) -> None:
        """The command's result: JSON on stdout with --json, else the human text (or a Rich renderable)."""
        if self.json_mode:
            sys.stdout.write(json.dumps(payload, indent=2, default=str) + "\n")
        elif not self.quiet:
            self.out.print(human)

    def info(self, message: str) -> None:
        """Progress and hints, to stderr; silent with --quiet or --json."""
        if not self.quiet and not self.json_mode:
            self.err.print(message)


def _debug() -> bool:
    return os.environ.get("LINNET_DEBUG", "") not in ("", "0")


def report_error(message: str, hint: str | None = None) -> None:
    err = Console(file=sys.stderr, no_color=_no_color(), highlight=False, soft_wrap=True)
    err.print(f"[bold red]error:[/] {escape(message)}", markup=True)
    if hint:
        err.print(f"[dim]hint:[/] {escape(hint)}", markup=True)


def handle_errors(fn: Callable) -> Callable:
    """Map LinnetError (and any other failure) to one line, a hint and an exit code."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with warnings.catch_warnings():
            warnings.simplefilter("default")
            warnings.showwarning = _show_warning
            try:
                return fn(*args, **kwargs)
            except (typer.Exit, typer.Abort):
                raise
            except LinnetError as e:
                if _debug():
                    raise
                report_error(f"internal error: {e.message}" if e.bug else e.message, e.hint)
                raise typer.Exit(e.exit_code) from None
            except BrokenPipeError:  # `linnet run ... | head`: the reader left; not an error
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
                raise typer.Exit(EXIT_OK) from None
            except KeyboardInterrupt:
                report_error("interrupted")
                raise typer.Exit(EXIT_INTERRUPTED) from None
            except Exception as e:  # a bug: still one line unless debugging
                if _debug():
                    raise
                if _out_of_space(e):
                    where = f" on the device of {e.filename}" if getattr(e, "filename", None) else ""
                    report_error(f"no space left{where}",
                                 "free some space (`linnet cache prune` frees compiled artifacts), or write elsewhere")
                    raise typer.Exit(EXIT_FAILURE) from None
                report_error(f"internal error: {type(e).__name__}: {e}".splitlines()[0],
                             "run again with LINNET_DEBUG=1 for the traceback, and report it")
                raise typer.Exit(EXIT_FAILURE) from None

    return wrapper


def _out_of_space(e: BaseException) -> bool:
    """A full disk or quota, from Python's own writes or a library's (safetensors, ONNX: their text)."""
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return "No space left on device" in str(e) or "Disk quota exceeded" in str(e)


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    sys.stderr.write(f"{getattr(category, 'prefix', 'warning')}: {message}\n")  # a notice says "note"


def check_output_files(*paths: Path | None) -> None:
    """Files a command writes at its end, checked before minutes of work rather than after."""
    for path in paths:
        if path is None:
            continue
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise InputError(f"cannot write {path}: {e.strerror}") from None
        if path.is_dir():
            raise InputError(f"{path} is a folder; give the name of the file to write")


def write_json(sink: Sink, path: Path | None, doc: dict) -> None:
    """--save: the --json document to `path` too (checked writable at the start by check_output_files)."""
    if path is not None:
        path.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
        sink.info(f"wrote {path}")
