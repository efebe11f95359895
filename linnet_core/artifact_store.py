"""A store of compiled artifacts shared by many machines, so a cluster compiles each artifact once.

Set by `LINNET_ARTIFACT_STORE` (or `linnet serve --artifact-store`): a folder every node mounts
(`/mnt/shared/linnet`, `file://...`) or an object-store URL (`s3://bucket/linnet`, `gs://...`),
reached through fsspec, the filesystem layer pandas, Dask, Hugging Face and Ray already use (s3 needs
`s3fs`, gs `gcsfs`, installed beside it). The store mirrors the cache's `artifacts/` folders. An
entry is published files first and manifest last, so a reader sees no entry until it is whole, and
a fetched entry is checked against its manifest's checksums before any of it is used, as a local
entry is at each load; one that fails is compiled here instead.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

from .errors import InputError

STORE_ENV = "LINNET_ARTIFACT_STORE"
MANIFEST = "manifest.json"


class StoreWarning(UserWarning):
    """The shared store could not be read or written; the cache works on without it."""


class SharedStore:
    def __init__(self, url: str):
        try:
            import fsspec  # noqa: I001 - a dependency of huggingface_hub; imported only where a store is set
            self.fs, self.root = fsspec.core.url_to_fs(url)
        except (ImportError, ValueError) as e:
            raise InputError(f"cannot open the artifact store {url!r}: {e}",
                             hint="install the filesystem it names (s3fs for s3://, gcsfs for gs://)") from None
        self.url = url

    @classmethod
    def from_env(cls) -> SharedStore | None:
        url = os.environ.get(STORE_ENV, "").strip()
        return cls(url) if url else None

    def _path(self, dirname: str, name: str = "") -> str:
        return "/".join(p for p in (self.root.rstrip("/"), "artifacts", dirname, name) if p)

    def fetch(self, dirname: str, digest: str, dest: Path) -> bool:
        """Copy the published entry `dirname` into the empty folder `dest`; False when the store has
        none for `digest` (or cannot be read: a warning says why)."""
        try:
            manifest_path = self._path(dirname, MANIFEST)
            if not self.fs.exists(manifest_path):
                return False
            raw = self.fs.cat_file(manifest_path)
            manifest = json.loads(raw)
            if manifest.get("digest") != digest:
                return False
            for name in manifest["files"]:
                target = (dest / name).resolve()
                if not target.is_relative_to(dest.resolve()):  # the store is shared: its manifest is input
                    raise ValueError(f"the manifest names a file outside its entry: {name!r}")
                target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
                self.fs.get_file(self._path(dirname, name), str(target))
                os.chmod(target, 0o600)
            (dest / MANIFEST).write_bytes(raw)
            return True
        except (OSError, ValueError, KeyError, TypeError) as e:
            warnings.warn(f"the artifact store {self.url} could not give {dirname} ({e}); compiling here",
                          StoreWarning, stacklevel=2)
            return False

    def publish(self, folder: Path, dirname: str) -> None:
        """Copy a complete local entry into the store, unless it is there already."""
        try:
            if self.fs.exists(self._path(dirname, MANIFEST)):
                return
            files = sorted(f for f in folder.rglob("*") if f.is_file() and f.name != MANIFEST)
            for f in files:
                remote = self._path(dirname, str(f.relative_to(folder)))
                self.fs.makedirs(remote.rsplit("/", 1)[0], exist_ok=True)
                self.fs.put_file(str(f), remote)
            self.fs.put_file(str(folder / MANIFEST), self._path(dirname, MANIFEST))  # last: the entry is whole
        except OSError as e:
            warnings.warn(f"could not publish {dirname} to the artifact store {self.url} ({e})", StoreWarning,
                          stacklevel=2)
