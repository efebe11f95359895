"""Token choice per request: greedy, or temperature / top-k / top-p / min-p sampling, after logit
bias, repetition penalties and a grammar's mask, with the log-probabilities of what was chosen when
asked.

The order is vLLM's: bias, then penalties, the grammar's mask, temperature, then min-p, top-k and top-p. Penalties
follow vLLM's (and OpenAI's) definitions: `presence_penalty` and `frequency_penalty` count the
tokens generated so far, `repetition_penalty` (transformers' CTRL rule: a positive score divided, a
negative one multiplied) every token of the prompt and of the output. Log-probabilities are those of
the distribution after bias, penalties, the mask and temperature (temperature 1 for a greedy request), before
min-p / top-k / top-p cut it: the probabilities the model gave, sharpened as the request asked.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from ..errors import InputError
from .constraints import Constraint

MAX_TOP_LOGPROBS = 20  # OpenAI's limit on top_logprobs


@dataclass(frozen=True)
class TokenLogprobs:
    """A token's log-probability and the `k` most likely tokens' at its position (best first); None
    for a prompt's first token, which nothing before it predicts."""

    token: int
    logprob: float | None
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = all tokens
    seed: int | None = None
    min_p: float = 0.0  # drop tokens below min_p x the most likely one's probability
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its score)
    logprobs: int | None = None  # None: none; k: the chosen token's and the k most likely (0..20)
    grammar: Any = field(default=None, compare=False)  # a compiled grammar (constraints.Grammars.compile)

    def __post_init__(self):
        if not self.temperature >= 0:
            raise InputError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InputError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InputError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise InputError(f"min_p must be in [0, 1], got {self.min_p}")
        if not (math.isfinite(self.presence_penalty) and math.isfinite(self.frequency_penalty)):
            raise InputError("the presence and frequency penalties must be finite")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise InputError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not all(math.isfinite(b) for _, b in self.logit_bias):
            raise InputError("logit_bias values must be finite")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise InputError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def shapes_scores(self) -> bool:
        """Whether bias or a penalty changes the scores (then even a greedy pick needs the logits)."""
        return bool(self.logit_bias or self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1)


class Sampler:
    """One request's token chooser: its own generator (seeded runs repeat exactly), the tokens it has
    chosen (for the penalties) and, when asked, the log-probabilities of its last choice."""

    def __init__(self, params: SamplingParams | None = None, prompt: Sequence[int] = ()):
        self.params = params or SamplingParams()
        self._generator: torch.Generator | None = None
        self._prompt = tuple(prompt) if self.params.repetition_penalty != 1 else ()
        self._chosen: list[int] = []
        self._counts: Counter[int] = Counter()
        self._logprobs: list[TokenLogprobs] = []  # of the choices since they were last taken
        self.constraint = Constraint(self.params.grammar) if self.params.grammar is not None else None

    @property
    def greedy(self) -> bool:
        """Whether the device's argmax is this sampler's whole choice (nothing to shape, nothing to report)."""
        p = self.params
        return p.greedy and not p.shapes_scores and p.logprobs is None and p.grammar is None

    def snapshot(self):
        """What `restore` needs so that a step that failed and is rerun chooses the same again."""
        state = None if self._generator is None else (self._generator, self._generator.get_state())
        return state, len(self._chosen), self.constraint.accepted if self.constraint else 0

    def restore(self, snapshot) -> None:
        state, chosen, accepted = snapshot
        if self.constraint is not None:
            self.constraint.rollback(accepted)
        if state is None:
            self._generator = None
        else:
            self._generator = state[0]
            self._generator.set_state(state[1])
        for token in self._chosen[chosen:]:
            self._counts[token] -= 1
        del self._chosen[chosen:]
        self._logprobs.clear()  # the failed step's choices are made again

    def take_logprobs(self) -> TokenLogprobs | None:
        """The log-probabilities of the last choice, once (None when none were asked for)."""
        out = self.take_all_logprobs()
        return out[-1] if out else None

    def take_all_logprobs(self) -> list[TokenLogprobs]:
        """The log-probabilities of every choice since they were last taken (a speculative step makes several)."""
        out, self._logprobs = self._logprobs, []
        return out

    def pick(self, logits: torch.Tensor) -> int:
        """Choose a token from logits [V] (on whatever device they live on)."""
        dist, final = self.scores(logits)
        if self.params.greedy:
            token = int(final.argmax())
        else:
            token = int(torch.multinomial(final.softmax(-1), 1, generator=self.generator(logits.device)))
        self.accept(token, dist)
        return token

    def scores(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What this request's choice at logits [V] is made from, given the tokens accepted so far:
        (the scores log-probabilities are read from, the scores drawn from (argmax'd when greedy))."""
        p = self.params
        scores = self._shaped(logits.float())
        if self.constraint is not None:
            scores = self.constraint.mask(scores)
        if p.greedy:
            return scores, scores
        # Relative to the best score, so a tiny temperature sends the rest to -inf, never inf - inf = NaN;
        # floored at float32's smallest normal, which a Python float below it would round to 0 (0 / 0).
        scores = (scores - scores.max()) / max(p.temperature, torch.finfo(torch.float32).tiny)
        dist = scores
        if p.min_p:
            probs = scores.softmax(-1)
            scores = scores.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
        if p.top_k:
            kth = torch.topk(scores, min(p.top_k, scores.numel())).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if p.top_p < 1:
            sorted_scores, order = torch.sort(scores, descending=True)
            cum = sorted_scores.softmax(-1).cumsum(-1)
            drop = cum - sorted_scores.softmax(-1) >= p.top_p  # keep the smallest set reaching top_p
            scores = scores.scatter(0, order, sorted_scores.masked_fill(drop, float("-inf")))
        return dist, scores

    def accept(self, token: int, dist: torch.Tensor) -> None:
        """Record `token` as chosen where `dist` (scores' first part) held: its log-probabilities when
        asked, the penalties' counts, the grammar's state."""
        p = self.params
        if p.logprobs is not None:
            self._logprobs.append(_logprobs(dist, token, p.logprobs))
        if p.shapes_scores:
            self._chosen.append(token)
            self._counts[token] += 1
        if self.constraint is not None:
            self.constraint.accept(token)

    def generator(self, device: torch.device) -> torch.Generator:
        """This request's random stream on `device` (seeded when the request gave a seed)."""
        if self._generator is None or self._generator.device != device:
            self._generator = torch.Generator(device=device)
            self._generator.manual_seed(self.params.seed if self.params.seed is not None else torch.seed())
        return self._generator

    def _shaped(self, scores: torch.Tensor) -> torch.Tensor:
        """Bias, then the penalties, on a float32 copy of the scores."""
        p = self.params
        if not p.shapes_scores:
            return scores
        scores = scores.clone()
        if p.logit_bias:
            ids = torch.tensor([i for i, _ in p.logit_bias], device=scores.device)
            scores.index_add_(0, ids, torch.tensor([b for _, b in p.logit_bias], device=scores.device))
        if p.repetition_penalty != 1 and (self._prompt or self._chosen):
            seen = torch.tensor(sorted(set(self._prompt) | set(self._chosen)), device=scores.device)
            picked = scores[seen]
            scores[seen] = torch.where(picked > 0, picked / p.repetition_penalty, picked * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and self._counts:
            live = [(t, n) for t, n in self._counts.items() if n > 0]
            if live:
                ids = torch.tensor([t for t, _ in live], device=scores.device)
                counts = torch.tensor([float(n) for _, n in live], device=scores.device)
                scores[ids] -= p.frequency_penalty * counts + p.presence_penalty
        return scores


def _logprobs(scores: torch.Tensor, token: int, k: int) -> TokenLogprobs:
    return logprobs_at(scores.log_softmax(-1), token, k)


def logprobs_at(logp: torch.Tensor, token: int, k: int) -> TokenLogprobs:
    """`token`'s entry in log-probabilities [V], with the k likeliest (those a mask left possible)."""
    top = ()
    if k:
        values, ids = torch.topk(logp, min(k, logp.numel()))
        top = tuple((int(i), float(v)) for i, v in zip(ids.tolist(), values.tolist()) if v != float("-inf"))
    return TokenLogprobs(token, float(logp[token]), top)
