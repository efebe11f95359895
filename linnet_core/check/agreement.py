"""How far a backend's logits are from the reference's: one home for every measure `verify`, the
quantization effect and the export round trips judge by (distance against a dtype's tolerance,
top-1 agreement, decisive top-1, KL divergence, perplexity)."""

from __future__ import annotations

import numpy as np

# Times max(1, max |reference logit|). "int8": activations quantized to int8 per block of 32 before
# each matmul (ONNX Runtime's MatMulNBits, llama.cpp's q8_0 dot products): 8 bits, as bfloat16's.
# "int8/256": llama.cpp's K-quant dot products round activations to int8 blocks of 256 (Q8_K), a
# coarser scale than 32's.
TOLERANCE = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 5e-2, "int8": 5e-2, "int8/256": 1e-1}


def compare_logits(logits: np.ndarray, reference: np.ndarray, dtype: str) -> tuple[float, float, float]:
    """(distance, tolerance, top-1 agreement) of logits [N, V] against the reference's [N, V]."""
    distance = float(np.abs(logits - reference).max())
    top1 = float((logits.argmax(-1) == reference.argmax(-1)).mean())
    return distance, tolerance_for(reference, dtype), top1


def tolerance_for(reference: np.ndarray, dtype: str) -> float:
    """The dtype's rounding error at the size of the reference logits."""
    return TOLERANCE[dtype] * max(1.0, float(np.abs(reference).max()))


def decisive_agreement(logits: np.ndarray, reference: np.ndarray, dtype: str) -> float:
    """Top-1 agreement over the positions where the reference's first choice leads its second by
    more than the dtype's rounding error (verify's tolerance): where it does not, the reference
    itself could have picked either, and agreeing there says nothing (random weights give many)."""
    noise = tolerance_for(reference, dtype if dtype in TOLERANCE else "bfloat16")
    top2 = np.sort(reference, axis=-1)[:, -2:]  # [N, 2]
    decisive = top2[:, 1] - top2[:, 0] > noise
    if not decisive.any():
        decisive[:] = True  # nothing stands out: every position counts
    return float((logits[decisive].argmax(-1) == reference[decisive].argmax(-1)).mean())


def log_softmax(x: np.ndarray) -> np.ndarray:
    """Log-probabilities of logits [T, V], in float64 (a float32 sum over a large vocabulary drifts)."""
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def mean_kld(reference_logp: np.ndarray, logp: np.ndarray) -> float:
    """Mean KL divergence (reference ‖ other) over positions, of log-probabilities [T, V]."""
    return float((np.exp(reference_logp) * (reference_logp - logp)).sum(-1).mean())


def perplexity(logp: np.ndarray, ids: list[int]) -> float:
    """The perplexity of log-probabilities [T, V] over the text `ids` (position t predicts ids[t + 1])."""
    nxt = np.asarray(ids[1:])
    if not len(nxt):
        return float("nan")
    return float(np.exp(-logp[np.arange(len(nxt)), nxt].mean()))
