"""A draft's tokens checked by the target: the acceptance rule of speculative decoding.

Greedy: each proposed token is kept while it is the target's own choice at its position, and the
target's choice at the first mismatch (or after the last token) follows, so the output is the plain
run's. Sampled: the standard rejection rule (Leviathan et al. 2023; Chen et al. 2023): keep a token
d drawn from the proposer's q with probability min(1, p(d) / q(d)), else draw from the normalised
residual max(0, p - q), which leaves every kept token distributed as the target's p.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from .sampling import Sampler


@dataclass(frozen=True)
class Draft:
    """Proposed next tokens, and the distribution each was drawn from ([k, V], on any device);
    None where each was certain (prompt lookup, or a greedy draft model)."""

    tokens: tuple[int, ...]
    probs: Any = None


def judge(sampler: Sampler | None, draft: Draft, greedy: Sequence[int], logits: Any) -> list[int]:
    """The tokens a target step over [last token, *draft.tokens] yields: the accepted prefix of the
    draft, then one token of the target's own. `greedy` [k + 1] are the target's argmaxes and
    `logits` [k + 1, V] its logits (a torch tensor, any device) at those positions."""
    k = len(draft.tokens)
    if sampler is None or sampler.params.greedy:
        # the device's argmax, or (shaped, constrained or reporting) the sampler's own choice, row by row
        choose = (lambda i: int(greedy[i])) if sampler is None or sampler.greedy else (lambda i: sampler.pick(logits[i]))
        out = []
        for i in range(k + 1):
            out.append(choose(i))
            if i == k or out[-1] != draft.tokens[i]:
                return out
    out = []
    gen = sampler.generator(logits.device)
    for i in range(k + 1):
        dist, final = sampler.scores(logits[i])
        p = final.softmax(-1)
        if i == k:  # every proposal kept: the target's next token, as a plain step draws it
            token = int(torch.multinomial(p, 1, generator=gen))
        else:
            d = draft.tokens[i]
            q = _aligned(draft.probs[i], p) if draft.probs is not None else None
            q_d = float(q[d]) if q is not None else 1.0
            p_d = float(p[d]) if d < p.numel() else 0.0  # a draft's vocabulary may run past the target's
            if float(torch.rand(1, generator=gen, device=p.device)) * q_d <= p_d:
                sampler.accept(d, dist)
                out.append(d)
                continue
            if q is not None:
                residual = (p - q[:p.numel()]).clamp_min(0)
            else:
                residual = p.index_fill(0, torch.tensor([d], device=p.device), 0) if d < p.numel() else p
            total = float(residual.sum())
            # p == q up to rounding: nothing is left to draw from but p itself (d is then never rejected
            # in exact arithmetic, so this only absorbs float32's last bits)
            token = int(torch.multinomial(residual / total if total > 0 else p, 1, generator=gen))
        sampler.accept(token, dist)
        out.append(token)
        return out
    raise AssertionError("unreachable")


def _aligned(q: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """The draft's distribution q on p's device, over at least p's vocabulary (zeros past its own)."""
    q = q.to(p.device, torch.float32)
    return torch.nn.functional.pad(q, (0, p.numel() - q.numel())) if q.numel() < p.numel() else q
