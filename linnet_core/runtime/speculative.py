"""Speculative decoding: a proposer guesses the next k tokens, the target model checks all of them
in one multi-token step over its KV cache (one read of the weights, as a one-token step), and the
acceptance rule (drafts.judge) keeps exactly what the target alone would produce.

A rejected token's cache positions need no rollback: a step at position t attends over positions
[0, t] only, so what lies beyond the accepted prefix is never read before it is written again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol, Sequence

import numpy as np
import torch

from ..errors import InputError
from .drafts import Draft
from .sampling import Sampler, SamplingParams
from .session import Chunk

# A verify step of k + 1 tokens costs about (1 + VERIFY_SLOPE * k) one-token steps when each weight
# is read once for all rows; the adaptive draft length plans with it.
VERIFY_SLOPE = 0.075
DEFAULT_DRAFT_TOKENS = 4
MAX_DRAFT_TOKENS = 16


class Proposer(Protocol):
    def propose(self, rows: Sequence[tuple[int, Sequence[int], int, Sampler | None]]) -> list[Draft | None]:
        """For each (cache row, context so far, most tokens, the row's sampler): a draft, or None."""


class PromptLookup:
    """Proposals copied from the context itself (prompt lookup decoding): the tokens that followed
    the latest earlier occurrence of the context's last n tokens, n from `max_ngram` down to
    `min_ngram`. No second model; it pays off where the output repeats spans of the prompt (code
    edits, extraction, summaries that quote)."""

    def __init__(self, min_ngram: int = 2, max_ngram: int = 4):
        if not 1 <= min_ngram <= max_ngram:
            raise InputError(f"prompt lookup needs 1 <= min n-gram <= max n-gram, got {min_ngram} and {max_ngram}")
        self.min_ngram, self.max_ngram = min_ngram, max_ngram

    def propose(self, rows):
        return [self.lookup(context, k) for _, context, k, _ in rows]

    def lookup(self, context: Sequence[int], k: int) -> Draft | None:
        ctx = np.asarray(context, dtype=np.int64)
        for n in range(min(self.max_ngram, len(ctx) - 1), self.min_ngram - 1, -1):
            # every earlier window of n tokens that has at least one token after it
            windows = np.lib.stride_tricks.sliding_window_view(ctx[:-1], n)
            hits = np.flatnonzero((windows == ctx[-n:]).all(axis=1))
            if len(hits):
                after = int(hits[-1]) + n
                return Draft(tuple(int(t) for t in ctx[after:after + k]))
        return None


class DraftModel:
    """Proposals from a smaller model with the same tokenizer, run in a session of its own whose
    row r mirrors the target's row r. Before each proposal the row is brought up to the context
    (the positions it already holds, by its own record of what it wrote, are not computed again),
    then it decodes k tokens: greedily for a greedy request, else by the request's temperature and
    cut-offs (its own generator), keeping the distribution each token came from."""

    def __init__(self, session):
        self.session = session

    def propose(self, rows):
        s = self.session
        live = []
        for slot, context, k, sampler in rows:
            k = min(k, s.cache_len - len(context))
            if k < 1 or slot >= s.rows:
                continue
            held = min(s.row_contents.shared(slot, np.asarray(context, dtype=np.int64)), len(context) - 1)
            live.append(_Drafting(slot, list(context), held, k, _draft_sampler(sampler)))
        for step in range(max((d.k for d in live), default=0)):
            going = [d for d in live if len(d.tokens) < d.k]
            chunks = [Chunk(d.context[d.held:] if step == 0 else [d.tokens[-1]],
                            d.held if step == 0 else len(d.context) + step - 1, d.slot, d.sampler) for d in going]
            for d, token in zip(going, s.step(chunks), strict=True):
                d.tokens.append(token)
                if d.sampler is not None:
                    d.probs.append(d.sampler.drawn_from)
        out: dict[int, Draft] = {d.slot: Draft(tuple(d.tokens), torch.stack(d.probs) if d.probs else None)
                                 for d in live}
        return [out.get(slot) for slot, *_ in rows]


@dataclass
class _Drafting:
    slot: int
    context: list[int]
    held: int  # positions of the context the draft's row already holds
    k: int
    sampler: _DraftSampler | None
    tokens: list[int] = field(default_factory=list)
    probs: list[torch.Tensor] = field(default_factory=list)


class _DraftSampler(Sampler):
    """A draft's sampler: the request's temperature and cut-offs (no penalties, bias or grammar:
    any q is exact under the rule, these only cost acceptance), remembering what it drew from."""

    drawn_from: torch.Tensor | None = None

    def pick(self, logits: torch.Tensor) -> int:
        _, final = self.scores(logits)
        self.drawn_from = final.softmax(-1)
        return int(torch.multinomial(self.drawn_from, 1, generator=self.generator(logits.device)))


def _draft_sampler(target: Sampler | None) -> _DraftSampler | None:
    if target is None or target.params.greedy:
        return None  # a greedy request's draft proposes its own argmax: certain, no distribution needed
    p = target.params
    seed = None if p.seed is None else p.seed ^ 0x5EED_D4AF  # seeded runs repeat; the streams stay apart
    return _DraftSampler(SamplingParams(p.temperature, p.top_p, p.top_k, seed, p.min_p))


class DraftLength:
    """How many tokens to propose next for one request: the k that maximises expected tokens per
    unit of work, (1 - a^(k+1)) / (1 - a) over 1 + k * (draft cost + VERIFY_SLOPE), from a running
    acceptance rate a; at most `most`. `draft_cost` is one draft step's cost in target steps."""

    def __init__(self, most: int, draft_cost: float, adaptive: bool = True, prior: float = 0.7):
        self.most, self.draft_cost, self.adaptive = most, draft_cost, adaptive
        self.rate = prior  # running acceptance rate of proposed tokens

    def next(self) -> int:
        if not self.adaptive:
            return self.most
        a = min(self.rate, 0.999)
        best, best_k = 0.0, 1
        for k in range(1, self.most + 1):
            gain = (1 - a ** (k + 1)) / (1 - a) / (1 + k * (self.draft_cost + VERIFY_SLOPE))
            if gain > best:
                best, best_k = gain, k
        return best_k

    def observe(self, proposed: int, accepted: int, weight: float = 0.3) -> None:
        if proposed:
            self.rate += weight * (accepted / proposed - self.rate)


@dataclass
class SpeculativeStats:
    """Proposed and accepted tokens, and target steps that verified a draft."""

    proposed: int = 0
    accepted: int = 0
    steps: int = 0  # target steps that checked a draft
    tokens: int = 0  # tokens those steps yielded

    def add(self, proposed: int, accepted: int, tokens: int) -> None:
        self.proposed += proposed
        self.accepted += accepted
        self.steps += 1
        self.tokens += tokens

    @property
    def acceptance(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_step(self) -> float:
        # with no draft checked, every target step yielded its one token
        return self.tokens / self.steps if self.steps else 1.0

    def to_json(self) -> dict:
        return {"proposed": self.proposed, "accepted": self.accepted, "verify_steps": self.steps,
                "acceptance": round(self.acceptance, 4), "tokens_per_step": round(self.tokens_per_step, 4)}


@dataclass(frozen=True)
class Speculation:
    """What `run`, `serve` and `bench` speculate with: a proposer, the most tokens it proposes per
    step, whether that adapts to the acceptance rate, and one draft step's cost in target steps."""

    proposer: Proposer
    most: int = DEFAULT_DRAFT_TOKENS
    adaptive: bool = True
    draft_cost: float = 0.0

    def __post_init__(self):
        if not 1 <= self.most <= MAX_DRAFT_TOKENS:
            raise InputError(f"--draft-tokens must be in [1, {MAX_DRAFT_TOKENS}], got {self.most}")

    def length(self, most: int | None = None) -> DraftLength:
        """A request's draft length: at most `most` (a request's own cap) and this speculation's."""
        return DraftLength(min(most or self.most, self.most), self.draft_cost, self.adaptive)

    def propose(self, rows: Sequence[tuple[int, Sequence[int], int, Sampler | None]],
                vocab_size: int) -> list[Draft | None]:
        """The proposer's drafts, each cut before its first token the target has no embedding for
        (a draft's vocabulary may be padded past the target's)."""
        out = []
        for draft in self.proposer.propose(rows):
            n = next((i for i, t in enumerate(draft.tokens) if not 0 <= t < vocab_size), None) if draft else None
            if draft is not None and n is not None:
                draft = Draft(draft.tokens[:n], None if draft.probs is None else draft.probs[:n]) if n else None
            out.append(draft)
        return out


def draft_cost(draft_bytes: float, target_bytes: float) -> float:
    """A draft decode step's cost in target steps: the weights each reads (both memory-bound)."""
    return max(draft_bytes / target_bytes, 0.0) if target_bytes > 0 and math.isfinite(draft_bytes) else 0.0
