"""Folders whose contents Linnet runs (generated modules, inductor's and XLA's compiled code, the
decode kernels' shared object) must be the user's own: a folder someone else can write into is
their code running as you. Created 0700; an existing one is refused, in one line with the fix,
when another user owns it or its group or others may write to it."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from .errors import CacheError


def make_private_dir(path: Path) -> None:
    """mkdir -p with every folder it creates 0700 (the umask cannot widen it); then checked."""
    missing = []
    p = Path(path)
    while not p.exists() and p != p.parent:
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        try:
            d.mkdir(mode=0o700)
        except FileExistsError:
            pass  # another process made it first: checked below like any existing folder
        else:
            os.chmod(d, 0o700)
    check_private(path)


def check_private(path: Path, st: os.stat_result | None = None) -> None:
    """Refuse `path` (a folder or a file in one) unless the current user owns it and neither group nor
    others may write to it."""
    if not hasattr(os, "getuid"):  # no POSIX owners here
        return
    st = st or os.stat(path)
    if st.st_uid != os.getuid():
        raise CacheError(f"{path} belongs to another user (uid {st.st_uid}); Linnet runs code it finds there, so "
                         "it uses only folders of your own",
                         hint="point LINNET_CACHE (LINNET_KERNELS for the kernels) at a folder of your own")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        who = " and ".join(w for w, bit in (("its group", stat.S_IWGRP), ("others", stat.S_IWOTH))
                           if st.st_mode & bit)
        raise CacheError(f"{path} is writable by {who}; Linnet runs code it finds there, so it refuses it",
                         hint=f"chmod go-w '{path}' (or point LINNET_CACHE at a folder of your own)")
