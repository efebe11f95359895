"""Advisory file locks (flock) whose holder is a live open file, not a PID: they free themselves when
the process ends however it ends, and mean the same across containers and hosts sharing a folder."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path


class SharedLock:
    """A shared lock held until `release` (or until dropped, or the process ends)."""

    def __init__(self, path: Path):
        self._fd: int | None = None  # set first: __del__ runs even when the open below raises
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self._fd, fcntl.LOCK_SH)  # waits only while someone holds it exclusively

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the lock
            self._fd = None

    def __del__(self):
        self.release()


def try_exclusive(path: Path) -> int | None:
    """An exclusive lock on `path` when nobody holds it (a descriptor: close it to release), else None."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd
