"""The ragged form of a step: N tokens from any mix of cache rows, laid out as ragged graphs
(ir.ragged.to_ragged) take them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class RaggedLayout:
    """One-token entries (decode rows) come first, then the chunks; index lists are flat."""

    ids: list[int]  # [N]
    pos: list[int]  # [N] position of each token in its row
    token_slots: list[int]  # [N] cache row of each token
    d_slots: list[int]  # [Bd] rows of the one-token entries (the first Bd tokens)
    d_kv_len: int  # positions those rows attend over (at least 1)
    p_slots: list[int]  # [Bp] rows of the chunks
    p_index: list[list[int]]  # [Bp, Tp] token of each chunk position; a short chunk repeats its last
    p_pack: list[int]  # [Np] each chunk token's place in the flattened [Bp, Tp]
    p_kv_len: int  # positions the chunks attend over (at least 1)
    logits_index: list[int]  # [E] tokens whose logits and next token are wanted

    @property
    def chunk_len(self) -> int:  # Tp
        return len(self.p_index[0]) if self.p_index else 1

    def inputs(self) -> dict[str, tuple[list, tuple[int, ...]]]:
        """Each graph input (ir.ragged.RAGGED_INPUTS) as flat int values and their shape."""
        n, bp = len(self.ids), len(self.p_slots)
        return {
            "ids": (self.ids, (1, n)), "pos": (self.pos, (1, n)), "token_slots": (self.token_slots, (1, n)),
            "d_slots": (self.d_slots, (len(self.d_slots),)), "d_kv_len": ([self.d_kv_len], (1,)),
            "p_slots": (self.p_slots, (bp,)), "p_index": ([i for row in self.p_index for i in row], (bp, self.chunk_len)),
            "p_pack": (self.p_pack, (len(self.p_pack),)), "p_kv_len": ([self.p_kv_len], (1,)),
            "logits_index": (self.logits_index, (len(self.logits_index),)),
        }


def ragged_layout(ids: Sequence[Sequence[int]], start: Sequence[int], slots: Sequence[int],
                  all_logits: bool = False) -> RaggedLayout:
    """Entries of any lengths as one ragged step; logits for each entry's last token, in the
    entries' order (for every token, in layout order, when all_logits)."""
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]) > 1)  # stable: equal kinds keep their order
    first, n = {}, 0
    for i in order:
        first[i], n = n, n + len(ids[i])
    single = [i for i in order if len(ids[i]) == 1]
    chunks = [i for i in order if len(ids[i]) > 1]
    tp = max((len(ids[i]) for i in chunks), default=1)
    # A short chunk repeats its last token: same query, same position, its output dropped.
    return RaggedLayout(
        ids=[t for i in order for t in ids[i]],
        pos=[start[i] + k for i in order for k in range(len(ids[i]))],
        token_slots=[slots[i] for i in order for _ in ids[i]],
        d_slots=[slots[i] for i in single],
        d_kv_len=max([start[i] + 1 for i in single], default=1),
        p_slots=[slots[i] for i in chunks],
        p_index=[[first[i] + min(k, len(ids[i]) - 1) for k in range(tp)] for i in chunks],
        p_pack=[j * tp + k for j, i in enumerate(chunks) for k in range(len(ids[i]))],
        p_kv_len=max([start[i] + len(ids[i]) for i in chunks], default=1),
        logits_index=list(range(n)) if all_logits else [first[i] + len(ids[i]) - 1 for i in range(len(ids))],
    )
