"""Token choice on the device: greedy, or temperature / top-k / top-p sampling per request."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import InputError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = all tokens
    seed: int | None = None

    def __post_init__(self):
        if not self.temperature >= 0:
            raise InputError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InputError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InputError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


class Sampler:
    """One request's token chooser; holds its own generator so seeded runs repeat exactly."""

    def __init__(self, params: SamplingParams | None = None):
        self.params = params or SamplingParams()
        self._generator: torch.Generator | None = None

    @property
    def greedy(self) -> bool:
        return self.params.greedy

    def snapshot(self):
        """The generator's state, for `restore` (a step that failed and is rerun draws the same)."""
        return None if self._generator is None else (self._generator, self._generator.get_state())

    def restore(self, state) -> None:
        if state is None:
            self._generator = None
        else:
            self._generator = state[0]
            self._generator.set_state(state[1])

    def pick(self, logits: torch.Tensor) -> int:
        """Choose a token from logits [V] (on whatever device they live on)."""
        p = self.params
        if p.greedy:
            return int(logits.argmax())
        if self._generator is None or self._generator.device != logits.device:
            self._generator = torch.Generator(device=logits.device)
            self._generator.manual_seed(p.seed if p.seed is not None else torch.seed())
        # Relative to the best score, so a tiny temperature sends the rest to -inf, never inf - inf = NaN;
        # floored at float32's smallest normal, which a Python float below it would round to 0 (0 / 0).
        scores = logits.float()
        scores = (scores - scores.max()) / max(p.temperature, torch.finfo(torch.float32).tiny)
        if p.top_k:
            kth = torch.topk(scores, min(p.top_k, scores.numel())).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if p.top_p < 1:
            sorted_scores, order = torch.sort(scores, descending=True)
            cum = sorted_scores.softmax(-1).cumsum(-1)
            drop = cum - sorted_scores.softmax(-1) >= p.top_p  # keep the smallest set reaching top_p
            scores = scores.scatter(0, order, sorted_scores.masked_fill(drop, float("-inf")))
        probs = scores.softmax(-1)
        return int(torch.multinomial(probs, 1, generator=self._generator))
