"""Rotary embedding frequencies, computed once here for every emitter (default, linear, llama3, and
per-frequency factors as a GGUF's rope_freqs tensor gives them)."""

from __future__ import annotations

import math

from ..errors import IRError


def inv_freq(rope: dict, rotary_dim: int) -> list[float]:
    """Inverse frequencies [rotary_dim // 2], as transformers computes them (float32 there)."""
    base = [1.0 / (rope["theta"] ** (i / rotary_dim)) for i in range(0, rotary_dim, 2)]
    kind = rope["type"]
    if kind == "default":
        return base
    if kind == "linear":
        return [f / rope["factor"] for f in base]
    if kind == "llama3":
        factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
        old_len = rope["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        out = []
        for f in base:
            wavelen = 2 * math.pi / f
            if wavelen < high_wavelen:
                out.append(f)
            elif wavelen > low_wavelen:
                out.append(f / factor)
            else:  # smooth interpolation between the two regimes
                smooth = (old_len / wavelen - low) / (high - low)
                out.append((1 - smooth) * f / factor + smooth * f)
        return out
    if kind == "freq_factors":  # llama.cpp: theta = pos * base_freq / factor
        factors = rope["freq_factors"]
        if len(factors) != len(base):
            raise IRError(f"rope: {len(factors)} frequency factors for {len(base)} frequencies")
        return [f / k for f, k in zip(base, factors)]
    raise IRError(f"rope type {kind!r} reached the emitter unchecked")
