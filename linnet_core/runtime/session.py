"""Session: the runtime contract every backend fulfils over its compiled artifact.

`prefill(ids, slot, start)` runs T prompt tokens of one cache row; `decode(ids, positions, slots)`
runs one token for each of B rows at once; `step(chunks)` runs any mix of both, each on its own
row (a serving engine's iteration). All return the next token per row, chosen on the device
(greedy unless a Sampler says otherwise), and only move logits to the host on request.
"""

from __future__ import annotations

from abc import ABC
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from ..errors import InputError
from .drafts import Draft, judge
from .ragged import RaggedLayout, ragged_layout
from .row_contents import RowContents
from .sampling import Sampler


@dataclass(frozen=True)
class Chunk:
    """Tokens for one cache row in a mixed step: a piece of a prompt, or the one token a decoding
    row feeds back."""

    ids: Sequence[int]
    start: int  # position of ids[0] in the row
    slot: int
    sampler: Sampler | None = None  # how this chunk's next token is chosen (greedy when None)
    draft: Draft | None = None  # ids end with these proposed tokens, checked in this step (speculative decoding)


@dataclass
class StepOutput:
    tokens: list[int]  # next token per row
    logits: np.ndarray | None = None  # float32 [B, T', V] when asked for


class Session(ABC):
    backend: str
    dtype: str
    rows: int
    cache_len: int
    vocab_size: int
    # The capability consulted in one place (`_forward`, `step`): a ragged session runs every step,
    # prefill, decode or mixed, as one call of its ragged graph (ir.ragged); a dense one runs
    # B rows of T tokens per call and a mixed step as one call per chunk length.
    ragged: bool = False

    def _run(self, ids: Sequence[Sequence[int]], start: Sequence[int], slots: Sequence[int],
             all_logits: bool) -> tuple[Any, Any]:
        """A dense step on the device: (greedy next tokens [B], logits [B, T', V]), device tensors."""
        raise NotImplementedError(f"{type(self).__name__} takes ragged steps only")

    def _run_ragged(self, layout: RaggedLayout) -> tuple[Any, Any]:
        """A ragged step on the device: (greedy next tokens [E], logits [E, 1, V]), device tensors."""
        raise NotImplementedError(f"{type(self).__name__} takes dense steps only")

    def _forward(self, ids: Sequence[Sequence[int]], start: Sequence[int], slots: Sequence[int],
                 all_logits: bool) -> tuple[Any, Any]:
        """B rows of equal length, in whichever step form this session takes."""
        if not self.ragged:
            return self._run(ids, start, slots, all_logits)
        greedy, logits = self._run_ragged(ragged_layout(ids, start, slots, all_logits))
        if all_logits:  # one entry per token, rows in order: [B*T] and [B*T, 1, V]
            B, T = len(ids), len(ids[0])
            return greedy.reshape(B, T)[:, -1], logits.reshape(B, T, -1)
        return greedy, logits

    def _to_host(self, tensor: Any) -> np.ndarray:
        """A device tensor as a float32 / int64 numpy array (sessions keep torch tensors)."""
        t = tensor.detach().to("cpu")
        return t.float().numpy() if t.is_floating_point() else t.numpy()

    def _check(self, length: int, start: int, slot: int) -> None:
        if not 0 <= slot < self.rows:
            raise InputError(f"cache row {slot} is out of range (this session has {self.rows} rows)")
        if start < 0 or start + length > self.cache_len:
            raise InputError(
                f"{start + length} positions do not fit the cache length {self.cache_len}",
                hint="use a shorter prompt or fewer new tokens, or compile with a larger --cache-len",
            )

    def _choose(self, greedy: Any, logits: Any, samplers: Sequence[Sampler | None]) -> list[int]:
        tokens = [int(t) for t in self._to_host(greedy).reshape(-1)]
        for row, sampler in enumerate(samplers):
            if sampler is not None and not sampler.greedy:
                tokens[row] = self._sample(logits, row, sampler)
        return tokens

    def _sample(self, logits: Any, row: int, sampler: Sampler) -> int:
        return sampler.pick(logits[row, -1])

    def prefill(self, ids: Sequence[int], slot: int = 0, start: int = 0, *, logits: str = "none",
                sampler: Sampler | None = None) -> StepOutput:
        """Run prompt tokens `ids` at positions start.. of cache row `slot`.

        logits: "none", "last" ([1, 1, V]) or "all" ([1, T, V]).
        """
        if not len(ids):
            raise InputError("the prompt is empty")
        self._check(len(ids), start, slot)
        with self._writing([(slot, start, ids)]):
            greedy, out = self._forward([list(ids)], [start], [slot], all_logits=logits == "all")
        tokens = self._choose(greedy, out, [sampler])
        return StepOutput(tokens, self._to_host(out) if logits != "none" else None)

    def decode(self, ids: Sequence[int], positions: Sequence[int], slots: Sequence[int], *, logits: bool = False,
               samplers: Sequence[Sampler | None] | None = None) -> StepOutput:
        """One token for each of B rows: ids[b] at positions[b] of cache row slots[b]."""
        if not (len(ids) == len(positions) == len(slots)) or not len(ids):
            raise InputError("decode needs one id, one position and one slot per row")
        if len(set(slots)) != len(slots):
            raise InputError("decode got the same cache row twice in one step")
        for p, s in zip(positions, slots):
            self._check(1, p, s)
        with self._writing([(s, p, [t]) for t, p, s in zip(ids, positions, slots)]):
            greedy, out = self._forward([[t] for t in ids], list(positions), list(slots), all_logits=False)
        tokens = self._choose(greedy, out, samplers or [None] * len(ids))
        return StepOutput(tokens, self._to_host(out) if logits else None)

    @property
    def row_contents(self) -> RowContents:
        """What each row holds, kept from the first time it is asked for (before that, nobody reads it)."""
        contents = self.__dict__.get("_row_contents")
        if contents is None:
            contents = self.__dict__["_row_contents"] = RowContents(self.rows, self.cache_len)
        return contents

    @contextmanager
    def _writing(self, pieces):
        """Around a call that writes `pieces` ((row, start, ids)): recorded in `row_contents` when it
        succeeds; when it fails, whatever it may have written from each start on is not trusted."""
        contents = self.__dict__.get("_row_contents")
        try:
            yield
        except BaseException:
            if contents is not None:
                for slot, start, _ in pieces:
                    contents.truncate(slot, start)
            raise
        if contents is not None:
            for slot, start, ids in pieces:
                contents.wrote(slot, start, ids)

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Make cache row `dst` hold what row `src` holds in positions [0, n) (prefix caching: a prompt
        that starts as another row's does not compute those positions again)."""
        if not (0 <= src < self.rows and 0 <= dst < self.rows and 0 <= n <= self.cache_len):
            raise InputError(f"cannot copy {n} positions from row {src} to row {dst}")
        if src != dst and n:
            contents = self.__dict__.get("_row_contents")
            try:
                self._copy_rows(src, dst, n)
            except BaseException:
                if contents is not None:
                    contents.truncate(dst, 0)  # a copy that fails leaves nothing of dst trusted
                raise
            if contents is not None:
                contents.copied(src, dst, n)

    def _copy_rows(self, src: int, dst: int, n: int) -> None:
        raise NotImplementedError

    def step(self, chunks: Sequence[Chunk]) -> list[int]:
        """Run every chunk, each on its own cache row; the next token after each chunk."""
        return [tokens[-1] for tokens in self.step_tokens(chunks)]

    def step_tokens(self, chunks: Sequence[Chunk]) -> list[list[int]]:
        """Run every chunk, each on its own cache row; what each yields: its next token, or for a
        chunk that ends with a draft, the draft's accepted tokens and then the target's next one."""
        if not chunks or any(not len(c.ids) for c in chunks):
            raise InputError("a step needs at least one chunk, and no chunk may be empty")
        if len({c.slot for c in chunks}) != len(chunks):
            raise InputError("a step got the same cache row twice")
        for c in chunks:
            self._check(len(c.ids), c.start, c.slot)
            if c.draft is not None and not 0 < len(c.draft.tokens) == len(c.ids) - 1:
                raise InputError("a draft's chunk is the row's last token and then the draft's")
        with self._writing([(c.slot, c.start, c.ids) for c in chunks]):
            return self._run_chunks(chunks)

    def _run_chunks(self, chunks: Sequence[Chunk]) -> list[list[int]]:
        # A draft's chunk runs as one-token entries of its row, one per position: each computed as a
        # decode step computes it (the same kernels, rows read together), so the check keeps exactly
        # the tokens plain decoding would choose. Every entry writes its keys and values before any attends.
        entries: list[tuple[Sequence[int], int, int]] = []  # (ids, start, slot)
        spans = []  # each chunk's entries
        for c in chunks:
            pieces = [([t], c.start + i, c.slot) for i, t in enumerate(c.ids)] if c.draft else [(c.ids, c.start, c.slot)]
            spans.append(range(len(entries), len(entries) + len(pieces)))
            entries += pieces
        if self.ragged:
            greedy, logits = self._run_ragged(ragged_layout([e[0] for e in entries], [e[1] for e in entries],
                                                            [e[2] for e in entries]))
            greedy = self._to_host(greedy).reshape(-1)
            return [self._yield(c, greedy, logits, span) for c, span in zip(chunks, spans, strict=True)]
        # Dense: one batched call per entry length (the one-token entries together), each entry's
        # results at its own index of the step's.
        at = [0] * len(entries)
        by_length: dict[int, list[int]] = {}
        for i, e in enumerate(entries):
            by_length.setdefault(len(e[0]), []).append(i)
        greedy_parts, logit_parts = [], []
        for idx in by_length.values():
            greedy, logits = self._run([list(entries[i][0]) for i in idx], [entries[i][1] for i in idx],
                                       [entries[i][2] for i in idx], all_logits=False)
            base = sum(len(p) for p in greedy_parts)
            for j, i in enumerate(idx):
                at[i] = base + j
            greedy_parts.append(self._to_host(greedy).reshape(-1))
            logit_parts.append(logits)
        greedy = np.concatenate(greedy_parts)
        if not any(c.sampler is not None and not c.sampler.greedy for c in chunks):
            logits = None  # every choice is the device's argmax: no logits are read
        else:
            logits = logit_parts[0] if len(logit_parts) == 1 else self._concat(logit_parts)
        return [self._yield(c, greedy, logits, [at[i] for i in span]) for c, span in zip(chunks, spans, strict=True)]

    def _concat(self, parts: list[Any]) -> Any:
        """Logits [B_i, 1, V] of several calls as one [sum B_i, 1, V] (torch tensors; XLA's sessions override)."""
        return torch.cat(parts)

    def _yield(self, chunk: Chunk, greedy: np.ndarray, logits: Any, rows: Sequence[int]) -> list[int]:
        """What `chunk` yields from its entries' rows `rows` of the step's greedy tokens and logits [E, 1, V]."""
        if chunk.draft is None:
            if chunk.sampler is None or chunk.sampler.greedy:
                return [int(greedy[rows[-1]])]
            return [self._sample(logits, rows[-1], chunk.sampler)]
        mine = self._logit_rows(logits, rows) if chunk.sampler is not None and not chunk.sampler.greedy else None
        return judge(chunk.sampler, chunk.draft, [int(greedy[r]) for r in rows], mine)

    def _logit_rows(self, logits: Any, rows: Sequence[int]) -> Any:
        """The logits of entries `rows` as a torch tensor [len(rows), V]."""
        return logits[list(rows), -1]
