"""The artifact cache: compiled models on disk, keyed by everything that changes them.

Key: model identity (canonical config + a fingerprint of every weight file), backend, dtype,
cache length, the versions of Linnet and of the backend's toolchain, and a digest of the Linnet
sources that write artifacts or prepare weights (sources.py: an edited emitter never meets an entry the old code made). An
entry is built in a temporary folder and renamed into place, so readers see complete entries or
none; a file lock per key makes concurrent compiles of one key build once; an entry whose
manifest or files do not check out is moved aside and rebuilt with a warning. Prepared weights are stored once per
model, dtype and layout (weight_store) and hard-linked into every entry that uses them.

What an entry holds is run (generated modules, inductor's and XLA's compiled code), so the cache is
the user's own (private_dirs: created 0700, refused when another user owns it or may write to it),
every file but the weights is checked against its manifest checksum at each load, and files the
manifest does not list (compiled code a session added later) are deleted before a load, to be
compiled again. A process using an entry holds a shared lock on it (`Lease`); removal takes that
lock exclusively without waiting and leaves an entry in use where it is.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import time
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from filelock import FileLock

from . import __version__
from .artifact_store import SharedStore
from .errors import CacheError
from .file_locks import SharedLock, try_exclusive
from .private_dirs import check_private, make_private_dir
from .sources import artifact_sources_digest
from .weight_store import BLOBS, Blob, Placer, WeightKey, WeightStore

MANIFEST = "manifest.json"
FULL_HASH_LIMIT = 64 * 1024 * 1024  # files up to this size are hashed whole
SAMPLES, SAMPLE_BYTES = 16, 1024 * 1024


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
            {"linnet": __version__, "sources": artifact_sources_digest(), "identity": self.identity, "backend": self.backend,
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


class Lease(SharedLock):
    """A shared lock on one entry, held while a process may read it (its session's lifetime): removal
    takes the lock exclusively, so it never pulls an entry out from under a user."""


class EntryInUse(CacheError):
    """A removal found the entry held by a process using it: left in place."""

    default_hint = "stop the processes using it (servers, sessions), then remove it again"


@dataclass(frozen=True)
class Entry:
    path: Path
    hit: bool
    manifest: dict[str, Any]
    lease: Lease | None = None  # held by whoever loads from the entry
    fetched: bool = False  # copied from the shared artifact store, not compiled here


class ArtifactCache:
    def __init__(self, root: Path | None = None, shared: SharedStore | None = None):
        self.root = Path(root) if root is not None else cache_root()
        self.store = WeightStore(self.root)
        self.shared = shared if shared is not None else SharedStore.from_env()  # a cluster's: artifact_store.py

    @property
    def artifacts(self) -> Path:
        return self.root / "artifacts"

    def _prepare(self) -> None:
        try:
            make_private_dir(self.root)
            for sub in ("artifacts", "tmp", "locks", "trash", BLOBS):
                make_private_dir(self.root / sub)
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
                if "sha256" not in meta and _checksummed(f):
                    raise ValueError(f"{name} has no checksum")  # an older cache's entry: built again
                if "sha256" in meta and _sha256_file(f) != meta["sha256"]:
                    raise ValueError(f"{name} has the wrong checksum")
        except (OSError, ValueError, KeyError, TypeError, json.JSONDecodeError) as e:
            raise _Damaged(str(e)) from None
        return manifest

    def _vet(self, path: Path, manifest: dict[str, Any]) -> None:
        """Before a load: every folder and file the user's own and written by nobody else (a link
        into another folder is refused too), and files the manifest does not list deleted."""
        listed = set(manifest["files"]) | {MANIFEST}
        check_private(path)
        for d, dirs, files in os.walk(path):
            for name in dirs + files:
                f = Path(d) / name
                st = os.lstat(f)
                if stat.S_ISLNK(st.st_mode):
                    raise CacheError(f"{f} is a symbolic link; a cache entry holds none",
                                     hint=f"remove the entry: linnet cache rm {path.name}")
                check_private(f, st)
                if not stat.S_ISDIR(st.st_mode) and str(f.relative_to(path)) not in listed:
                    f.unlink(missing_ok=True)  # compiled after the manifest: unchecked, so compiled again

    def _discard(self, path: Path) -> None:
        trash = self.root / "trash" / f"{path.name}-{uuid.uuid4().hex[:8]}"
        try:
            os.rename(path, trash)
        except OSError:
            pass
        shutil.rmtree(trash, ignore_errors=True)

    def get_or_build(self, key: ArtifactKey, build: Callable[[Path], None], meta: dict[str, Any] | None = None) -> Entry:
        """The entry for `key`, building it with `build(tmp_folder)` when missing or damaged; its
        `lease` keeps removals away while the caller holds it."""
        self._prepare()
        path = self.artifacts / key.dirname
        lease = Lease(self._lock_path(key.digest[:32], "use"))
        try:
            return self._get_or_build(key, path, build, meta, lease)
        except BaseException:
            lease.release()
            raise

    def _get_or_build(self, key, path, build, meta, lease) -> Entry:
        try:
            manifest = self.check(path, key)
            if manifest is not None:
                self._vet(path, manifest)
                self.touch(path)
                if self.shared:  # compiled before the store was set: the cluster gets it too
                    self.shared.publish(path, key.dirname)
                return Entry(path, True, manifest, lease)
        except _Damaged:
            pass  # rebuilt below, under the lock
        with FileLock(str(self._lock_path(key.digest[:32], "lock"))):
            try:
                manifest = self.check(path, key)
                if manifest is not None:  # another process built it while we waited
                    self._vet(path, manifest)
                    self.touch(path)
                    return Entry(path, True, manifest, lease)
            except _Damaged as e:
                warnings.warn(f"cache entry {path.name} is damaged ({e}); rebuilding it", CacheWarning, stacklevel=2)
                self._discard(path)
            self._sweep_tmp(key.digest[:32])
            # named by the key's lock, held for the whole build: the sweep tells abandoned builds by it
            tmp = self.root / "tmp" / f"{key.digest[:32]}.{uuid.uuid4().hex[:8]}"
            tmp.mkdir(mode=0o700)
            try:
                manifest = self._fetch(key, tmp)
                fetched = manifest is not None
                if not fetched:
                    build(tmp)
                    manifest = self._write_manifest(tmp, key, meta or {})
                os.rename(tmp, path)
            except BaseException:  # Ctrl-C included: never leave a half entry
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            if self.shared and not fetched:
                self.shared.publish(path, key.dirname)
            return Entry(path, fetched, manifest, lease, fetched)

    def _fetch(self, key: ArtifactKey, tmp: Path) -> dict[str, Any] | None:
        """The shared store's entry for `key`, copied into `tmp` and checked as a local entry is; None
        (and `tmp` emptied) when the store has none or it does not check out."""
        if self.shared is None or not self.shared.fetch(key.dirname, key.digest, tmp):
            return None
        try:
            return self.check(tmp, key)
        except _Damaged as e:
            warnings.warn(f"the artifact store's {key.dirname} is damaged ({e}); compiling here", CacheWarning,
                          stacklevel=3)
            for child in tmp.iterdir():
                shutil.rmtree(child) if child.is_dir() else child.unlink()
            return None

    def _lock_path(self, digest: str, kind: str) -> Path:
        return self.root / "locks" / f"{digest}.{kind}"

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
                entry: dict[str, Any] = {"size": f.stat().st_size}
                if _checksummed(f):  # code and compiled code, whatever their size: checked by content
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
            try:
                if path.is_dir():
                    out.append(self._describe(path, blobs))
            except FileNotFoundError:  # removed by another process while it was listed
                continue
        return sorted(out, key=lambda e: -e.last_used)

    @staticmethod
    def _describe(path: Path, blobs: dict) -> CachedArtifact:
        """One entry as `entries` lists it: its manifest's fields, its own size, the weights it shares."""
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
            return CachedArtifact(path, m["model"], m["backend"], m["dtype"], int(m["cache_len"]), size,
                                  float(m["created"]), used, m.get("digest", "")[:32], True, tuple(shared))
        except (OSError, ValueError, KeyError, TypeError):
            mtime = path.stat().st_mtime
            return CachedArtifact(path, path.name, "?", "?", 0, size, mtime, mtime, "", False, tuple(shared))

    def remove(self, entry: CachedArtifact) -> None:
        """Delete an entry, under its key's build lock (no build of that key is cut short) and its use
        lock taken without waiting: an entry a process is using raises EntryInUse and stays. Then
        the stored weights no other entry uses."""
        self._prepare()
        if not entry.digest:  # damaged beyond reading its manifest: nothing can be loading it
            self._discard(entry.path)
        else:
            with FileLock(str(self._lock_path(entry.digest, "lock"))):
                fd = try_exclusive(self._lock_path(entry.digest, "use"))
                if fd is None:
                    raise EntryInUse(f"{entry.path.name} is in use by a running process; it was left in place")
                try:
                    self._discard(entry.path)
                finally:
                    os.close(fd)
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
            gone = self.remove_all(gone)[0]
            self.store.remove_unused()  # also what a removed entry's crash left unlinked
        return gone

    def remove_all(self, entries: list[CachedArtifact]) -> tuple[list[CachedArtifact], list[CachedArtifact]]:
        """Remove each entry that no process is using: (removed, left in place because in use)."""
        removed, in_use = [], []
        for e in entries:
            try:
                self.remove(e)
                removed.append(e)
            except EntryInUse:
                in_use.append(e)
        return removed, in_use

    def touch(self, path: Path) -> None:
        """Record a use (for `cache ls` and pruning by last use)."""
        try:
            os.utime(path / MANIFEST)
        except OSError:
            pass

    def _sweep_tmp(self, held: str) -> None:
        """Remove temporary folders of builds that ended without finishing. A build holds its key's
        lock until it is done, so a folder whose lock is free is abandoned, whichever host or
        container ran it (a PID means nothing across them). `held`: the key whose lock we hold."""
        for t in (self.root / "tmp").iterdir():
            digest = t.name.split(".")[0]
            if not t.is_dir() or len(digest) != 32:
                continue
            if digest == held:  # our own key: its builder, if any, was us
                shutil.rmtree(t, ignore_errors=True)
                continue
            fd = try_exclusive(self._lock_path(digest, "lock"))
            if fd is not None:
                try:
                    shutil.rmtree(t, ignore_errors=True)
                finally:
                    os.close(fd)


class _Damaged(Exception):
    pass


class CacheWarning(UserWarning):
    pass


def _checksummed(f: Path) -> bool:
    """Everything but the weights (safetensors: data, read by a parser that runs nothing)."""
    return f.suffix != ".safetensors"
