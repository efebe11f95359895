"""Exports: folders people take to other runtimes. Writing is all-or-nothing (see `output_folder`)."""

from __future__ import annotations

import os
import shutil
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from ..errors import InputError

# Files beside the weights that a consumer needs to tokenize and chat.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                   "chat_template.jinja", "chat_template.json", "generation_config.json")


@dataclass
class ExportResult:
    out: Path
    files: dict[str, int] = field(default_factory=dict)  # name -> bytes
    seconds: float = 0.0

    @property
    def total_bytes(self) -> int:
        return sum(self.files.values())


@contextmanager
def output_folder(out: Path, force: bool = False) -> Iterator[Path]:
    """A temporary folder beside `out` that becomes `out` only when the block completes.

    An existing `out` is refused unless `force`; a failure or Ctrl-C leaves no half-written folder.
    """
    out = Path(out)
    if out.exists() and not force:
        raise InputError(f"{out} already exists", hint="pass --force to replace it")
    if not out.parent.is_dir():
        raise InputError(f"{out.parent} is not a folder")
    tmp = out.parent / f".{out.name}.linnet-tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
        if out.exists():
            old = out.parent / f".{out.name}.linnet-old-{uuid.uuid4().hex[:8]}"
            os.rename(out, old)
            os.rename(tmp, out)
            shutil.rmtree(old, ignore_errors=True) if old.is_dir() else old.unlink()
        else:
            os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def copy_tokenizer(src: Path, dst: Path) -> None:
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)


def summarize(out: Path, started: float) -> ExportResult:
    files = {p.name: p.stat().st_size for p in sorted(out.iterdir()) if p.is_file()}
    return ExportResult(out, files, time.perf_counter() - started)
