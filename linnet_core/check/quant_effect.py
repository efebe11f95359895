"""What quantizing the weights costs, measured as llama.cpp's `perplexity --kl-divergence` does:
the quantized session against the original float32 model over a real text (the opening of *Pride
and Prejudice*, which the embedded model never saw), position by position.

Mean KL divergence (original ‖ quantized), top-1 agreement where the original's first choice is
decisive (as the export round trips count it), and the perplexity of both. q8_0 is gated
(GATES); q4_0 is reported. Only the original's logits are held while the session runs.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from .agreement import decisive_agreement, log_softmax, mean_kld, perplexity

GATES = {"q8_0": (0.01, 0.95)}  # mean KLD at most, top-1 agreement at least


@dataclass
class QuantEffect:
    text: str  # what was read: the unseen text, or the fixed ids of a model without a tokenizer
    tokens: int
    mean_kld: float
    top1_agreement: float
    perplexity_float: float
    perplexity_quantized: float
    gate: tuple[float, float] | None  # (max mean KLD, min top-1) or None: reported only
    passed: bool

    def to_json(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        gate = f" (gate: KLD ≤ {self.gate[0]:g}, top-1 ≥ {self.gate[1]:.0%})" if self.gate else " (reported)"
        return (f"against the float32 model over {self.tokens} tokens of {self.text}: mean KLD {self.mean_kld:.4g}, "
                f"top-1 {self.top1_agreement:.1%}, perplexity {self.perplexity_float:.4g} → "
                f"{self.perplexity_quantized:.4g}{gate}")


def measure(original: np.ndarray, quantized: np.ndarray, ids: list[int], fmt: str, text: str) -> QuantEffect:
    """Logits [T, V] of the original and the quantized model over `ids` -> the effect."""
    lp, lq = log_softmax(original), log_softmax(quantized)
    top1 = decisive_agreement(quantized, original, "bfloat16")
    kld = mean_kld(lp, lq)
    gate = GATES.get(fmt)
    passed = gate is None or (kld <= gate[0] and top1 >= gate[1])
    return QuantEffect(text, len(ids), kld, top1, perplexity(lp, ids), perplexity(lq, ids), gate, bool(passed))
