"""Exports: folders people take to other runtimes. Writing is all-or-nothing (see `output_folder`)."""

from __future__ import annotations

import os
import shutil
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import InputError
from ..gguf.tokenizer import write_tokenizer_files

# Files beside the weights that a consumer needs to tokenize and chat.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                   "chat_template.jinja", "chat_template.json", "generation_config.json")


@dataclass
class ExportResult:
    out: Path
    files: dict[str, int] = field(default_factory=dict)  # name -> bytes
    seconds: float = 0.0
    check: object = None  # the round-trip report, when the export checked itself
    notes: list[str] = field(default_factory=list)  # what a user of the export should know

    @property
    def total_bytes(self) -> int:
        return sum(self.files.values())


MARKER = ".linnet-export"  # in every folder Linnet exports: what --force may replace


def _refuse_existing(out: Path, force: bool, folder: bool) -> None:
    if out.exists() and not force:
        raise InputError(f"{out} already exists", hint="pass --force to replace it")
    if folder and out.exists() and not (out / MARKER).is_file() and not (out.is_dir() and not any(out.iterdir())):
        raise InputError(f"{out} is not a previous Linnet export, so --force will not replace it",
                         hint="remove it yourself, or choose another output folder")
    if not out.parent.is_dir():
        raise InputError(f"{out.parent} is not a folder")


def _move_into_place(tmp: Path, out: Path) -> None:
    """Rename `tmp` to `out`; an existing `out` is moved aside first and removed only afterwards."""
    if out.exists():
        old = out.parent / f".{out.name}.linnet-old-{uuid.uuid4().hex[:8]}"
        os.rename(out, old)
        os.rename(tmp, out)
        shutil.rmtree(old, ignore_errors=True) if old.is_dir() else old.unlink()
    else:
        os.rename(tmp, out)


def _discard(tmp: Path) -> None:
    shutil.rmtree(tmp, ignore_errors=True) if tmp.is_dir() else tmp.unlink(missing_ok=True)


@contextmanager
def _staged(out: Path, force: bool, folder: bool) -> Iterator[Path]:
    out = Path(out)
    _refuse_existing(out, force, folder)
    if not folder and out.is_dir():
        raise InputError(f"{out} is a folder; give the name of the file to write")
    tmp = out.parent / f".{out.name}.linnet-tmp-{uuid.uuid4().hex[:8]}"
    if folder:
        tmp.mkdir()
    try:
        yield tmp
        if folder:
            (tmp / MARKER).write_text("written by linnet export; `--force` replaces this folder\n")
        _move_into_place(tmp, out)
    except BaseException:
        _discard(tmp)
        raise


def output_folder(out: Path, force: bool = False):
    """A temporary folder beside `out` that becomes `out` only when the block completes.

    An existing `out` is refused unless `force`; a failure or Ctrl-C leaves no half-written folder.
    """
    return _staged(out, force, folder=True)


def output_file(out: Path, force: bool = False):
    """`output_folder` for a single file: a temporary name beside `out`, renamed when complete."""
    return _staged(out, force, folder=False)


def copy_tokenizer(src: Path, dst: Path) -> None:
    """The checkpoint's tokenizer files into `dst`; a GGUF source's tokenizer written out as files."""
    if src.is_file():
        write_tokenizer_files(src, dst)
        return
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)


def summarize(out: Path, started: float) -> ExportResult:
    if out.is_dir():
        files = {str(p.relative_to(out)): p.stat().st_size for p in sorted(out.rglob("*"))
                 if p.is_file() and p.name != MARKER}
    else:
        files = {out.name: out.stat().st_size}
    return ExportResult(out, files, time.perf_counter() - started)
