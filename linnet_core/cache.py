"""The artifact cache: compiled models on disk, keyed by everything that changes them.

Key: model identity (canonical config + a fingerprint of every weight file), backend, dtype,
cache length, the versions of Linnet and of the backend's toolchain, and a digest of the Linnet
sources that write artifacts (an edited emitter never meets an entry the old code made). An
entry is built in a temporary folder and renamed into place, so readers see complete entries or
none; a file lock per key makes concurrent compiles of one key build once; an entry whose
manifest or files do not check out is moved aside and rebuilt with a warning. Prepared weights are stored once per
model, dtype and layout (weight_store) and hard-linked into every entry that uses them.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import uuid
import warnings
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable

from filelock import FileLock

from . import __version__
from .errors import CacheError
from .weight_store import BLOBS, Blob, Placer, WeightKey, WeightStore

MANIFEST = "manifest.json"
FULL_HASH_LIMIT = 64 * 1024 * 1024  # files up to this size are hashed whole
SAMPLES, SAMPLE_BYTES = 16, 1024 * 1024


# What shapes an artifact's files: the IR, the model definitions, weight preparation and the emitters.
ARTIFACT_SOURCES = ("ir", "models", "backends", "params.py", "quant.py", "dtypes.py")


@lru_cache(maxsize=1)
def source_digest() -> str:
    """sha256 over the Linnet sources that write artifacts (a version bump is easy to forget)."""
    root = Path(__file__).parent
    h = hashlib.sha256()
    for entry in ARTIFACT_SOURCES:
        path = root / entry
        for f in sorted(path.rglob("*") if path.is_dir() else [path]):
            if f.suffix in (".py", ".cpp", ".h") and "__pycache__" not in f.parts:
                h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:16]


def cache_root() -> Path:
    env = os.environ.get("LINNET_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "linnet"


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def file_fingerprint(path: Path) -> str:
    """Identity of a weight file without reading gigabytes.

    A Hugging Face cache blob is named by its content's sha256, which is exact. Small files are
    hashed whole. Large local files: size, mtime and 16 sampled 1 MiB windows (header included),
    so a rewritten file changes the key even when its shapes do not.
    """
    real = path.resolve()
    if real.parent.name == "blobs" and len(real.name) == 64:
        return f"blob:{real.name}"
    st = real.stat()
    if st.st_size <= FULL_HASH_LIMIT:
        return f"sha256:{_sha256_file(real)}"
    h = hashlib.sha256(f"{st.st_size}:{st.st_mtime_ns}".encode())
    with open(real, "rb") as f:
        for k in range(SAMPLES):
            f.seek(k * (st.st_size - SAMPLE_BYTES) // (SAMPLES - 1))
            h.update(f.read(SAMPLE_BYTES))
    return f"sampled:{h.hexdigest()}"


def model_identity(config: dict, weight_files: list[Path]) -> str:
    canon = json.dumps(config, sort_keys=True, separators=(",", ":"))
    h = hashlib.sha256(canon.encode())
    for f in sorted(weight_files, key=lambda p: p.name):
        h.update(f"{f.name}={file_fingerprint(f)}\n".encode())
    return h.hexdigest()


@dataclass(frozen=True)
class ArtifactKey:
    model: str  # display name
    identity: str  # model_identity(...)
    backend: str
    dtype: str
    cache_len: int
    toolchain: tuple[tuple[str, str], ...]

    @property
    def digest(self) -> str:
        payload = json.dumps(
            {"linnet": __version__, "sources": source_digest(), "identity": self.identity, "backend": self.backend,
             "dtype": self.dtype, "cache_len": self.cache_len, "toolchain": dict(self.toolchain)},
            sort_keys=True,
        )
        return hashlib.sha256(payload.encode()).hexdigest()

    @property
    def dirname(self) -> str:
        slug = "".join(c if c.isalnum() or c in "-." else "-" for c in self.model.rstrip("/").split("/")[-1])[:40]
        return f"{slug}-{self.backend}-{self.dtype}-{self.cache_len}-{self.digest[:16]}"


@dataclass(frozen=True)
class CachedArtifact:
    """One cache entry as `linnet cache ls` shows it."""

    path: Path
    model: str
    backend: str
    dtype: str
    cache_len: int
    size: int
    created: float
    last_used: float
    digest: str  # names its lock
    intact: bool
    shared: tuple[str, ...] = ()  # the stored weights it links (their bytes are not in `size`)

    def to_json(self) -> dict[str, Any]:
        return {"path": str(self.path), "name": self.path.name, "model": self.model, "backend": self.backend,
                "dtype": self.dtype, "cache_len": self.cache_len, "bytes": self.size, "created": self.created,
                "last_used": self.last_used, "intact": self.intact, "shared_weights": list(self.shared)}


@dataclass(frozen=True)
class Entry:
    path: Path
    hit: bool
    manifest: dict[str, Any]


class ArtifactCache:
    def __init__(self, root: Path | None = None):
        self.root = Path(root) if root is not None else cache_root()
        self.store = WeightStore(self.root)

    @property
    def artifacts(self) -> Path:
        return self.root / "artifacts"

    def _prepare(self) -> None:
        try:
            for sub in ("artifacts", "tmp", "locks", "trash", BLOBS):
                (self.root / sub).mkdir(parents=True, exist_ok=True)
            probe = self.root / "tmp" / f".probe-{uuid.uuid4().hex}"
            probe.touch()
            probe.unlink()
        except OSError as e:
            raise CacheError(
                f"the artifact cache at {self.root} is not writable ({e.strerror or e})",
                hint="point LINNET_CACHE at a writable folder",
            ) from None

    def check(self, path: Path, key: ArtifactKey) -> dict[str, Any] | None:
        """The manifest of a complete, intact entry for `key`; None when absent; raises on damage."""
        manifest_path = path / MANIFEST
        if not path.exists():
            return None
        try:
            manifest = json.loads(manifest_path.read_text())
            if manifest["digest"] != key.digest:
                raise ValueError("digest differs")
            for name, meta in manifest["files"].items():
                f = path / name
                if f.stat().st_size != meta["size"]:
                    raise ValueError(f"{name} has the wrong size")
                if "sha256" in meta and _sha256_file(f) != meta["sha256"]:
                    raise ValueError(f"{name} has the wrong checksum")
        except (OSError, ValueError, KeyError, TypeError, json.JSONDecodeError) as e:
            raise _Damaged(str(e)) from None
        return manifest

    def _discard(self, path: Path) -> None:
        trash = self.root / "trash" / f"{path.name}-{uuid.uuid4().hex[:8]}"
        try:
            os.rename(path, trash)
        except OSError:
            pass
        shutil.rmtree(trash, ignore_errors=True)

    def get_or_build(self, key: ArtifactKey, build: Callable[[Path], None], meta: dict[str, Any] | None = None) -> Entry:
        """The entry for `key`, building it with `build(tmp_folder)` when missing or damaged."""
        self._prepare()
        path = self.artifacts / key.dirname
        try:
            manifest = self.check(path, key)
            if manifest is not None:
                self.touch(path)
                return Entry(path, True, manifest)
        except _Damaged:
            pass  # rebuilt below, under the lock
        with FileLock(str(self.root / "locks" / f"{key.digest[:32]}.lock")):
            try:
                manifest = self.check(path, key)
                if manifest is not None:  # another process built it while we waited
                    self.touch(path)
                    return Entry(path, True, manifest)
            except _Damaged as e:
                warnings.warn(f"cache entry {path.name} is damaged ({e}); rebuilding it", CacheWarning, stacklevel=2)
                self._discard(path)
            self._sweep_tmp()
            tmp = self.root / "tmp" / f"{key.dirname}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
            tmp.mkdir()
            try:
                build(tmp)
                manifest = self._write_manifest(tmp, key, meta or {})
                os.rename(tmp, path)
            except BaseException:  # Ctrl-C included: never leave a half entry
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            return Entry(path, False, manifest)

    def placer(self, key: ArtifactKey) -> Placer:
        """Where an entry's weights come from: the store's one copy for its model, dtype and layout."""
        def place(dest: Path, layout: str, fingerprint: str, write: Callable[[Path], None]) -> None:
            self.store.provide(WeightKey(key.identity, key.dtype, layout, fingerprint), write, dest,
                               {"model": key.model})
        return place

    def _write_manifest(self, folder: Path, key: ArtifactKey, meta: dict[str, Any]) -> dict[str, Any]:
        files = {}
        for f in sorted(folder.rglob("*")):
            if f.is_file():
                size = f.stat().st_size
                entry: dict[str, Any] = {"size": size}
                if size <= 16 * 1024 * 1024:  # small files (code, graphs) are checked by content too
                    entry["sha256"] = _sha256_file(f)
                files[str(f.relative_to(folder))] = entry
        manifest = {
            "digest": key.digest,
            "model": key.model,
            "identity": key.identity,
            "backend": key.backend,
            "dtype": key.dtype,
            "cache_len": key.cache_len,
            "toolchain": dict(key.toolchain),
            "linnet": __version__,
            "created": time.time(),
            "files": files,
            **meta,
        }
        (folder / MANIFEST).write_text(json.dumps(manifest, indent=2))
        return manifest

    def entries(self) -> list[CachedArtifact]:
        """Every artifact in the cache, most recently used first (a damaged one is listed as such)."""
        if not self.artifacts.is_dir():
            return []
        out = []
        blobs = self.store.inodes()
        for path in self.artifacts.iterdir():
            if not path.is_dir():
                continue
            size, shared = 0, []
            for f in path.rglob("*"):
                if not f.is_file():
                    continue
                st = f.stat()
                blob = blobs.get((st.st_dev, st.st_ino)) if st.st_nlink > 1 else None
                if blob is None:
                    size += st.st_size
                else:
                    shared.append(blob.path.name)
            try:
                m = json.loads((path / MANIFEST).read_text())
                used = (path / MANIFEST).stat().st_mtime
                out.append(CachedArtifact(path, m["model"], m["backend"], m["dtype"], int(m["cache_len"]), size,
                                          float(m["created"]), used, m.get("digest", "")[:32], True, tuple(shared)))
            except (OSError, ValueError, KeyError, TypeError):
                mtime = path.stat().st_mtime
                out.append(CachedArtifact(path, path.name, "?", "?", 0, size, mtime, mtime, "", False, tuple(shared)))
        return sorted(out, key=lambda e: -e.last_used)

    def remove(self, entry: CachedArtifact) -> None:
        """Delete an entry, under its key's lock so that no build or load of that key is cut short,
        then the stored weights no other entry uses."""
        self._prepare()
        lock = self.root / "locks" / f"{entry.digest}.lock" if entry.digest else None
        if lock is None:
            self._discard(entry.path)
        else:
            with FileLock(str(lock)):
                self._discard(entry.path)
        self.store.remove_unused()

    def freed_with(self, entries: list[CachedArtifact]) -> list[Blob]:
        """The stored weights that removing `entries` leaves unused (every user among them), and the
        ones nothing uses already."""
        out = []
        for b in self.store.blobs():
            users = sum(b.path.name in e.shared for e in entries)
            if users >= b.users:
                out.append(b)
        return out

    def shared_bytes(self, entries: list[CachedArtifact]) -> int:
        """The stored weights `entries` link, each counted once."""
        used = {name for e in entries for name in e.shared}
        return sum(b.size for b in self.store.blobs() if b.path.name in used)

    def prune(self, older_than_s: float | None = None, max_bytes: int | None = None,
              dry_run: bool = False) -> list[CachedArtifact]:
        """Remove entries unused for `older_than_s`, then the least recently used until the cache
        fits in `max_bytes`; damaged entries always go. Returns what was (or would be) removed."""
        now = time.time()
        keep, gone = [], []
        for e in self.entries():
            stale = older_than_s is not None and now - e.last_used > older_than_s
            (gone if stale or not e.intact else keep).append(e)
        if max_bytes is not None:
            while keep and sum(e.size for e in keep) + self.shared_bytes(keep) > max_bytes:
                gone.append(keep.pop())  # `entries` is most recent first: the last is least recent
        if not dry_run:
            for e in gone:
                self.remove(e)
            self.store.remove_unused()  # also what a removed entry's crash left unlinked
        return gone

    def touch(self, path: Path) -> None:
        """Record a use (for `cache ls` and pruning by last use)."""
        try:
            os.utime(path / MANIFEST)
        except OSError:
            pass

    def _sweep_tmp(self) -> None:
        """Remove temporary folders of processes that died mid-build."""
        for t in (self.root / "tmp").iterdir():
            try:
                pid = int(t.name.split(".")[-2])
            except (ValueError, IndexError):
                continue
            if pid != os.getpid() and not _alive(pid):
                shutil.rmtree(t, ignore_errors=True)


class _Damaged(Exception):
    pass


class CacheWarning(UserWarning):
    pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
