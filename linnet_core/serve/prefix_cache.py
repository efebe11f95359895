"""Automatic prefix caching over the session's cache rows.

The cache is laid out in rows, one request's positions each, so the index is over rows (a radix of
depth one, as llama-server's slots): the session keeps, for every row, busy or free, the tokens its
written positions hold (`RowContents`). A request placed in a row starts its prompt after the
longest prefix it shares with that row's content, and a free row keeps its content until it is
taken, so a later request with the same system prompt, few-shot examples or earlier chat turns finds
it there. When a busy row shares a longer prefix than any free row, its positions are copied into
the free row the request gets (`Session.copy_prefix`), and a request still filling its prompt copies
positions another row has filled meanwhile (requests that arrive together with one system prompt
compute it once: the oldest fills it, the others skip the steps that compute it and copy it). Free
rows are taken in least-recently-used order when no content matches: that is the eviction. A
position's keys and values depend only on the tokens up to it, so reused positions are those the
request would have computed.
"""

from __future__ import annotations

import numpy as np

from ..runtime.row_contents import RowContents

MIN_COPY = 16  # a shorter prefix is recomputed rather than copied from another row


class PrefixCache:
    """Where a request goes and what it reuses, over the session's `RowContents`."""

    def __init__(self, contents: RowContents):
        self.contents = contents
        self.used = np.zeros(len(contents.valid), dtype=np.int64)  # when each row was last given out (a clock)
        self._clock = 0

    def place(self, prompt, free: list[int], busy: list[int]) -> tuple[int, int, int | None]:
        """(row, reused positions, row to copy them from or None) for a request with `prompt`, given
        the free rows (at least one) and the busy ones. At least the prompt's last token is left to
        compute: its logits choose the first new token."""
        c = self.contents
        p = np.asarray(prompt, dtype=np.int64)[:-1]
        best_free = max(free, key=lambda r: (c.shared(r, p), self.used[r], -r))
        in_place = c.shared(best_free, p)
        best_busy, elsewhere = c.best(p, busy)
        self._clock += 1
        lru = min(free, key=lambda r: (self.used[r], r))  # the least recently used content goes
        if elsewhere >= max(MIN_COPY, in_place + MIN_COPY):
            row, reused, source = lru, elsewhere, best_busy
        elif in_place:
            row, reused, source = best_free, in_place, None
        else:
            row, reused, source = lru, 0, None
        self.used[row] = self._clock
        return row, reused, source

    def computed_beside(self, prompt, filled: int, planned: list[tuple[np.ndarray, int]]) -> bool:
        """Whether a chunk already planned for this step (its prompt, end) computes at least MIN_COPY
        more of `prompt` than the `filled` positions: then this request waits and copies them after."""
        p = np.asarray(prompt, dtype=np.int64)[:-1]
        for other, end in planned:
            n = min(len(p), end)
            differ = np.flatnonzero(p[:n] != other[:n])
            if (int(differ[0]) if len(differ) else n) >= filled + MIN_COPY:
                return True
        return False

    def catch_up(self, row: int, prompt, filled: int, rows) -> tuple[int | None, int]:
        """(row to copy from, positions) when another of `rows` holds at least MIN_COPY more of a
        filling request's prompt than the `filled` positions its own row has; else (None, filled)."""
        p = np.asarray(prompt, dtype=np.int64)[:-1]
        source, n = self.contents.best(p, (r for r in rows if r != row))
        return (source, n) if source is not None and n >= filled + MIN_COPY else (None, filled)
