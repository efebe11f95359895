"""How a server's answers stand against the reference: per request, greedy agreement up to the
first divergence, max |Δ logprob| of the chosen tokens and of the listed alternatives, top-k overlap
and the KL divergence over the server's top-k (the rest of the probability as one outcome), judged
against the claimed dtype's tolerance.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ..tokenizer import Tokenizer
from .agreement import TOLERANCE
from .served_ask import first_difference
from .server_api import Scored


@dataclass
class Comparison:
    """One request's tokens against the reference's distributions at the same positions."""
    name: str
    kind: str  # completion | chat
    prompt_tokens: int
    tokens: list[int | None]  # the server's greedy tokens (None: not identified)
    compared: int  # positions compared: the generated ones, then any prompt positions it scored
    agreement: int  # generated tokens that match the reference's first choice before the first that does not
    decisive_divergence: int | None  # first position where the server's token is clearly not the reference's first
    max_dlogprob: float | None  # chosen tokens
    max_dlogprob_top: float | None  # the alternatives the server listed
    top_overlap: float | None  # mean share of the server's top-k that is the reference's top-k
    kld: float | None  # mean over positions, over the server's top-k and the rest
    prompt_logprobs: int = 0  # prompt positions the server scored (echo / prompt_logprobs)
    logprobs: list[float | None] = field(default_factory=list)  # the server's chosen-token logprobs (baselines)
    passed: bool = True
    finding: str | None = None


class Bounds:
    """The claimed dtype's tolerance at the size of the reference's logits: a logprob is a logit less
    a log-sum, each rounded, so twice the logit tolerance; a KL divergence of at most half its square
    (Hoeffding's bound for logits off by at most the tolerance)."""

    def __init__(self, activations: str, reference_rounds: bool):
        self.activations, self.reference_rounds, self.scale = activations, reference_rounds, 1.0

    def see(self, logits: np.ndarray) -> None:
        self.scale = max(self.scale, float(np.abs(logits).max()))

    @property
    def logit(self) -> float:
        t = TOLERANCE[self.activations] * self.scale
        return 2 * t if self.reference_rounds else t  # two roundings, not one

    @property
    def logprob(self) -> float:
        return 2 * self.logit

    @property
    def kld(self) -> float:
        return self.logit ** 2 / 2


def compare(name: str, kind: str, prompt: list[int], generated: list[Scored], scored_prompt: list[Scored],
            logp: np.ndarray, bounds: Bounds, k: int) -> Comparison:
    """The server's tokens against the reference's log-probabilities `logp` [T, V] over prompt +
    generated (teacher-forced on the server's own tokens)."""
    tol = bounds.logprob
    chosen, listed, overlaps, klds, not_finite = [], [], [], [], []
    agreement, diverged, decisive, outside = 0, False, None, None

    def position(row: np.ndarray, s: Scored) -> None:
        values = [v for v in (s.logprob, *(lp for _, lp in s.top[:k])) if v is not None]
        if not all(math.isfinite(v) for v in values):  # NaN passes every comparison: counted, not compared
            not_finite.append(s)
            return
        if s.id is not None and s.logprob is not None:
            chosen.append(abs(s.logprob - row[s.id]))
        named = [(i, lp) for i, lp in s.top[:k] if i is not None and 0 <= i < len(row)]
        listed.extend(abs(lp - row[i]) for i, lp in named)
        if named:
            ref_top = set(np.argpartition(-row, len(named) - 1)[:len(named)].tolist())
            overlaps.append(len(ref_top & {i for i, _ in named}) / len(named))
            p = np.exp(np.array([row[i] for i, _ in named]))
            q = np.exp(np.array([lp for _, lp in named]))
            p_rest, q_rest = max(1 - p.sum(), 1e-12), max(1 - q.sum(), 1e-12)
            klds.append(float((p * (np.log(p) - np.log(np.maximum(q, 1e-30)))).sum()
                              + p_rest * (np.log(p_rest) - np.log(q_rest))))

    for j, s in enumerate(generated):
        row = logp[len(prompt) - 1 + j]
        if s.id is None:
            break  # a token not identified: the positions after it have no known context
        if not 0 <= s.id < len(row):
            outside = s.id
            break
        position(row, s)
        best = int(row.argmax())
        if s.id != best:
            diverged = True
            if decisive is None and row[best] - row[s.id] > tol:
                decisive = j
        if not diverged:
            agreement += 1
    for t, s in enumerate(scored_prompt[1:len(prompt)], start=1):  # position t - 1 predicts prompt[t]
        position(logp[t - 1], Scored(prompt[t], s.text, s.logprob, s.top))
    top = lambda v: max(v) if v else None  # noqa: E731
    c = Comparison(name, kind, len(prompt), [s.id for s in generated], len(chosen), agreement, decisive,
                   top(chosen), top(listed), float(np.mean(overlaps)) if overlaps else None,
                   float(np.mean(klds)) if klds else None, max(0, min(len(scored_prompt), len(prompt)) - 1),
                   [s.logprob for s in generated])
    problems = []
    if c.max_dlogprob is not None and c.max_dlogprob > tol:
        problems.append(f"a chosen token's logprob is {c.max_dlogprob:.3g} off the reference's (tolerance {tol:.3g})")
    if c.max_dlogprob_top is not None and c.max_dlogprob_top > tol:
        problems.append(f"a listed alternative's logprob is {c.max_dlogprob_top:.3g} off (tolerance {tol:.3g})")
    if c.kld is not None and c.kld > bounds.kld:
        problems.append(f"KL divergence over the top-{k} {c.kld:.3g} (bound {bounds.kld:.3g})")
    if decisive is not None:
        problems.append(f"greedy token {decisive + 1} is not the reference's first choice, which leads it by "
                        f"more than the tolerance")
    if not_finite:
        problems.append(f"{len(not_finite)} positions carry logprobs that are not finite numbers")
    if outside is not None:
        problems.append(f"the server answered token {outside}, outside the model's vocabulary of {logp.shape[1]}")
    if generated and generated[0].id is None:
        problems.append("the server's tokens could not be identified in the model's vocabulary")
    c.passed, c.finding = not problems, "; ".join(problems) or None
    return c


def compare_text(name: str, kind: str, prompt: list[int], text: str, greedy: list[int], logits: np.ndarray,
                 tok: Tokenizer, bounds: Bounds) -> Comparison:
    """A server's text (no logprobs) against the reference's greedy tokens `greedy` (with their logits
    [n, V]): agreement up to the token where the texts part; decisive where the reference's first
    choice there led its second by more than the tolerance (then no other token could be right)."""
    agreement, decisive = len(greedy), None
    # Whole texts compared (a prefix may end inside a UTF-8 character), without U+FFFD: decoders
    # render broken bytes as one or several, which says nothing about the model.
    def plain(t: str) -> str:
        return t.replace("\ufffd", "")

    text, ref_text = plain(text), plain(tok.decode(greedy))
    i = first_difference(text, ref_text)
    if i < len(text) and i < len(ref_text):  # they part (a shorter text is a stop, not a difference)
        agreement = next((j for j in range(len(greedy)) if len(plain(tok.decode(greedy[:j + 1]))) > i),
                         len(greedy) - 1)
        top2 = np.sort(logits[agreement])[-2:]
        decisive = agreement if top2[1] - top2[0] > bounds.logprob else None
    c = Comparison(name, kind, len(prompt), greedy[:agreement], 0, agreement, decisive, None, None, None, None)
    if decisive is not None:
        c.passed, c.finding = False, (f"the text parts from the reference's greedy text at token {decisive + 1}, where "
                                      f"the reference's first choice leads by more than the tolerance")
    return c
