"""Automatic prefix caching over the session's cache rows.

The cache is laid out in rows, one request's positions each, so the index is over rows (a radix of
depth one, as llama-server's slots): for every row, busy or free, the tokens whose keys and values
its first `valid` positions hold. A request placed in a row starts its prompt after the longest
prefix it shares with that row's content, and a free row keeps its content until it is taken, so a
later request with the same system prompt, few-shot examples or earlier chat turns finds it there.
When a busy row shares a longer prefix than any free row, its positions are copied into the free row
the request gets (`Session.copy_prefix`), and a request still filling its prompt copies positions
another row has filled meanwhile (requests that arrive together with one system prompt compute it
once: the oldest fills it, the others wait their turn and copy it). Free rows are taken in least-recently-used order when no
content matches: that is the eviction. A position's keys and values depend only on the tokens up
to it, so reused positions are those the request would have computed.
"""

from __future__ import annotations

import numpy as np

MIN_COPY = 16  # a shorter prefix is recomputed rather than copied from another row


class RowContents:
    """What each row's cache holds: tokens[row, :valid[row]] are written in positions [0, valid)."""

    def __init__(self, rows: int, cache_len: int):
        self.tokens = np.zeros((rows, cache_len), dtype=np.int64)
        self.valid = np.zeros(rows, dtype=np.int64)
        self.used = np.zeros(rows, dtype=np.int64)  # when each row was last given out (a clock)
        self._clock = 0

    def wrote(self, row: int, start: int, ids) -> None:
        """A step wrote `ids` at positions [start, start + len(ids)); whatever the row held past them is stale."""
        end = start + len(ids)
        self.tokens[row, start:end] = ids
        self.valid[row] = end

    def forget(self, row: int) -> None:
        self.valid[row] = 0

    def shared(self, row: int, prompt: np.ndarray) -> int:
        """How many leading tokens of `prompt` the row holds."""
        n = min(int(self.valid[row]), len(prompt))
        if n == 0:
            return 0
        differ = np.flatnonzero(self.tokens[row, :n] != prompt[:n])
        return int(differ[0]) if len(differ) else n

    def best(self, prompt: np.ndarray, rows) -> tuple[int | None, int]:
        """The row among `rows` sharing the longest prefix with `prompt`, and its length."""
        found, longest = None, 0
        for r in rows:
            n = self.shared(r, prompt)
            if n > longest:
                found, longest = r, n
        return found, longest

    def place(self, prompt, free: list[int], busy: list[int]) -> tuple[int, int, int | None]:
        """(row, reused positions, row to copy them from or None) for a request with `prompt`, given
        the free rows (at least one) and the busy ones. At least the prompt's last token is left to
        compute: its logits choose the first new token."""
        p = np.asarray(prompt, dtype=np.int64)[:-1]
        best_free = max(free, key=lambda r: (self.shared(r, p), self.used[r]))
        in_place = self.shared(best_free, p)
        best_busy, elsewhere = self.best(p, busy)
        self._clock += 1
        if elsewhere >= max(MIN_COPY, in_place + MIN_COPY):
            row = min(free, key=lambda r: self.used[r])  # the least recently used content goes
            self.used[row] = self._clock
            return row, elsewhere, best_busy
        row = best_free if in_place else min(free, key=lambda r: self.used[r])
        self.used[row] = self._clock
        return row, in_place, None

    def catch_up(self, row: int, prompt, filled: int, rows) -> tuple[int | None, int]:
        """(row to copy from, positions) when another of `rows` holds at least MIN_COPY more of a
        filling request's prompt than the `filled` positions its own row has; else (None, filled)."""
        p = np.asarray(prompt, dtype=np.int64)[:-1]
        source, n = self.best(p, (r for r in rows if r != row))
        return (source, n) if source is not None and n >= filled + MIN_COPY else (None, filled)

    def adopt(self, row: int, reused: int, source: int | None) -> None:
        """The row now holds the first `reused` positions of the request placed in it."""
        if source is not None:
            self.tokens[row, :reused] = self.tokens[source, :reused]
        self.valid[row] = reused
