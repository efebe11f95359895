"""Prepared weights stored once in the artifact cache, shared by every entry that uses the same bytes.

A blob is keyed by the model's identity, the storage dtype, the layout (which tensors, in which
shapes and order: one for the backends that load Linnet's safetensors, one for the ONNX ones) and a
digest of the sources that prepare weights (sources.WEIGHT_SOURCES), so every cache length, and every backend of the same layout, hard-links one blob into its entry: a
second cache length costs kilobytes. A blob is written to a temporary file and renamed into place
under its own lock, beside a sidecar with its size; one whose size disagrees (truncated, or half
written by a killed process) is written again. An entry's manifest still checks the size of its
own link, so an entry over a damaged blob is rebuilt as well. The link count says who uses a blob:
a blob with only the store's own link is unused, and only such blobs are ever deleted.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

from filelock import FileLock

from . import __version__
from .file_locks import try_exclusive
from .sources import weight_sources_digest
from .weights import drop_cached

# Layouts sessions map through weights.Checkpoint (in_huge_pages); ONNX Runtime reads its own.
MAPPED_LAYOUTS = ("safetensors",)
TMP_MARK = ".tmp-"  # a blob being written: .{blob}.tmp-{random}

BLOBS = "weights"


class Placer(Protocol):
    def __call__(self, dest: Path, layout: str, fingerprint: str, write: Callable[[Path], None]) -> None:
        """Put the weights `write(path)` would write at `dest`: written there, or linked from the store."""


def write_here(dest: Path, layout: str, fingerprint: str, write: Callable[[Path], None]) -> None:
    """The placer outside the cache (exports): every file written where it goes."""
    write(dest)


def fingerprint(layout: Any) -> str:
    """A digest of a layout's JSON-able description (names, shapes, dtypes, order)."""
    return hashlib.sha256(json.dumps(layout, sort_keys=True, default=str).encode()).hexdigest()


@dataclass(frozen=True)
class WeightKey:
    identity: str  # the model's (cache.model_identity)
    dtype: str
    layout: str  # its name, for people: "safetensors", "onnx"
    fingerprint: str  # of what the layout holds

    @property
    def digest(self) -> str:
        payload = {"linnet": __version__, "sources": weight_sources_digest(), "identity": self.identity,
                   "dtype": self.dtype, "layout": self.layout, "fingerprint": self.fingerprint}
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


@dataclass(frozen=True)
class Blob:
    """One stored weights file as `linnet cache ls` shows it."""

    path: Path
    size: int
    links: int  # the store's own, plus one per entry that uses it
    meta: dict

    @property
    def users(self) -> int:
        return self.links - 1

    def to_json(self) -> dict[str, Any]:
        return {"name": self.path.name, "bytes": self.size, "users": self.users, "model": self.meta.get("model"),
                "dtype": self.meta.get("dtype"), "layout": self.meta.get("layout")}


class WeightStore:
    def __init__(self, root: Path):
        self.root, self.dir = root, root / BLOBS

    def _lock(self, name: str) -> FileLock:
        (self.root / "locks").mkdir(parents=True, exist_ok=True)
        return FileLock(str(self.root / "locks" / f"weights-{name}.lock"))

    @staticmethod
    def _sidecar(blob: Path) -> Path:
        return blob.with_name(blob.name + ".json")

    def intact(self, blob: Path) -> bool:
        try:
            return blob.stat().st_size == json.loads(self._sidecar(blob).read_text())["size"]
        except (OSError, ValueError, KeyError, TypeError):
            return False

    def provide(self, key: WeightKey, write: Callable[[Path], None], dest: Path, meta: dict[str, Any]) -> Path:
        """Link the blob for `key` at `dest`, writing it first (with `write(path)`) when it is missing or
        damaged. The link is made under the blob's lock, so a prune never removes it in between."""
        self.dir.mkdir(parents=True, exist_ok=True)
        blob = self.dir / f"{key.digest[:32]}.{key.layout}"
        with self._lock(blob.name):
            if not self.intact(blob):
                self._sweep(blob.name)
                tmp = self.dir / f".{blob.name}{TMP_MARK}{uuid.uuid4().hex[:8]}"
                try:
                    write(tmp)
                    if key.layout in MAPPED_LAYOUTS:  # sessions map it: read back in 2 MiB pages
                        drop_cached(tmp)
                    side = tmp.with_name(tmp.name + ".json")
                    side.write_text(json.dumps({"size": tmp.stat().st_size, "created": time.time(), **meta,
                                                "dtype": key.dtype, "layout": key.layout, "identity": key.identity}))
                    os.replace(tmp, blob)
                    os.replace(side, self._sidecar(blob))
                finally:
                    for t in (tmp, tmp.with_name(tmp.name + ".json")):
                        t.unlink(missing_ok=True)
            try:
                os.link(blob, dest)
            except OSError:  # a file system without hard links: a copy, still built once per entry
                shutil.copyfile(blob, dest)
        return blob

    def blobs(self) -> list[Blob]:
        if not self.dir.is_dir():
            return []
        out = []
        for p in sorted(self.dir.iterdir()):
            if p.name.startswith(".") or p.name.endswith(".json") or not p.is_file():
                continue
            try:
                meta = json.loads(self._sidecar(p).read_text())
            except (OSError, ValueError):
                meta = {}
            st = p.stat()
            out.append(Blob(p, st.st_size, st.st_nlink, meta))
        return out

    def inodes(self) -> dict[tuple[int, int], Blob]:
        """(device, inode) -> blob: how an entry's file is recognised as a link to a shared blob."""
        out = {}
        for b in self.blobs():
            st = b.path.stat()
            out[(st.st_dev, st.st_ino)] = b
        return out

    def remove_unused(self, dry_run: bool = False) -> list[Blob]:
        """Delete every blob no entry links to (rechecked under its lock); returns them."""
        gone = []
        for b in self.blobs():
            if b.users > 0:
                continue
            with self._lock(b.path.name):
                try:
                    if b.path.stat().st_nlink > 1:
                        continue  # linked by a compile while we waited
                except FileNotFoundError:
                    continue
                if not dry_run:
                    b.path.unlink(missing_ok=True)
                    self._sidecar(b.path).unlink(missing_ok=True)
            gone.append(b)
        return gone

    def _sweep(self, held: str) -> None:
        """Temporary blobs of writes that ended without finishing: a write holds its blob's lock to
        the end, so one whose lock is free (or is `held`, ours) is abandoned, whichever host wrote it."""
        for t in self.dir.glob(".*"):
            if TMP_MARK not in t.name:
                continue
            name = t.name[1:].split(TMP_MARK)[0]  # .{blob}{TMP_MARK}{random}[.json]
            if name == held:
                t.unlink(missing_ok=True)
                continue
            fd = try_exclusive(self._lock(name).lock_file)
            if fd is not None:
                try:
                    t.unlink(missing_ok=True)
                finally:
                    os.close(fd)
