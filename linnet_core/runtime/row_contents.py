"""What each of a session's cache rows holds: the tokens whose keys and values its first positions
carry, kept by the session itself as every step writes (and a failed step invalidates), so whoever
reads it — the serving engine's prefix cache — sees every writer's work."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np


class RowContents:
    """tokens[row, :valid[row]] are the tokens whose keys and values positions [0, valid) hold."""

    def __init__(self, rows: int, cache_len: int):
        self.tokens = np.zeros((rows, cache_len), dtype=np.int64)
        self.valid = np.zeros(rows, dtype=np.int64)

    def wrote(self, row: int, start: int, ids: Sequence[int]) -> None:
        """A step wrote `ids` at [start, start + len(ids)): what the row held past them is stale
        (written in the context of other tokens)."""
        end = start + len(ids)
        self.tokens[row, start:end] = ids
        self.valid[row] = end

    def truncate(self, row: int, n: int) -> None:
        self.valid[row] = min(int(self.valid[row]), n)

    def copied(self, src: int, dst: int, n: int) -> None:
        self.tokens[dst, :n] = self.tokens[src, :n]
        self.valid[dst] = min(n, int(self.valid[src]))

    def shared(self, row: int, prompt: np.ndarray) -> int:
        """How many leading tokens of `prompt` the row holds."""
        n = min(int(self.valid[row]), len(prompt))
        if n == 0:
            return 0
        differ = np.flatnonzero(self.tokens[row, :n] != prompt[:n])
        return int(differ[0]) if len(differ) else n

    def best(self, prompt: np.ndarray, rows: Iterable[int]) -> tuple[int | None, int]:
        """The row among `rows` sharing the longest prefix with `prompt`, and its length."""
        found, longest = None, 0
        for r in rows:
            n = self.shared(r, prompt)
            if n > longest:
                found, longest = r, n
        return found, longest
