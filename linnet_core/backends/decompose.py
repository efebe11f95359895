"""The math of the high-level ops, written once for the graph emitters (ONNX, StableHLO).

Each function here is one piece of math (rope's rotate-half, the causal/windowed mask, softmax
and norm statistics in float32, the activations) written against `MathBuilder`, a small set of
primitives each graph emitter implements over its own values. An emitter lowers an op either to
its own fused kernel (ONNX's RMSNormalization, Gelu) or through the function here; nowhere else
is the math spelled out. The Python dialects (generated PyTorch and JAX) keep their templates.
"""

from __future__ import annotations

import math
from typing import Any, Protocol, Sequence

Value = Any  # an emitter's own handle: an ONNX value name, a StableHLO SSA value


class MathBuilder(Protocol):
    """Primitives over an emitter's values. Binary ops and `where` broadcast numpy-style."""

    def add(self, a: Value, b: Value) -> Value: ...
    def sub(self, a: Value, b: Value) -> Value: ...
    def mul(self, a: Value, b: Value) -> Value: ...
    def div(self, a: Value, b: Value) -> Value: ...
    def neg(self, a: Value) -> Value: ...
    def rsqrt(self, a: Value) -> Value: ...
    def cos(self, a: Value) -> Value: ...
    def sin(self, a: Value) -> Value: ...
    def tanh(self, a: Value) -> Value: ...
    def erf(self, a: Value) -> Value: ...
    def sigmoid(self, a: Value) -> Value: ...
    def le(self, a: Value, b: Value) -> Value: ...
    def gt(self, a: Value, b: Value) -> Value: ...
    def and_(self, a: Value, b: Value) -> Value: ...
    def where(self, cond: Value, a: Value, b: Value) -> Value: ...

    def scalar(self, value: float, kind: str) -> Value:
        """A constant scalar of kind "f32", "act" (the compute dtype) or "index" (integer positions)."""

    def f32_array(self, values: Sequence[float]) -> Value:
        """A constant float32 vector."""

    def to_f32(self, a: Value) -> Value:
        """An activation in float32 (a no-op when the compute dtype is float32)."""

    def index_to_f32(self, a: Value) -> Value:
        """Integer positions as float32."""

    def to_act(self, a: Value) -> Value:
        """A float32 value in the compute dtype (a no-op when that is float32)."""

    def mean_last(self, a: Value) -> Value:
        """The mean over the last axis, kept as a size-1 axis."""

    def sum_last(self, a: Value) -> Value:
        """The sum over the last axis, kept as a size-1 axis."""

    def max_last(self, a: Value) -> Value:
        """The largest value over the last axis, kept as a size-1 axis."""

    def softmax_last(self, a: Value) -> Value:
        """Softmax over the last axis, in the dtype of `a`."""

    def slice_last(self, a: Value, lo: int, hi: int) -> Value: ...
    def concat_last(self, parts: list[Value]) -> Value: ...
    def unsqueeze(self, a: Value, axes: list[int]) -> Value: ...

    def nibbles(self, a: Value) -> Value:
        """uint8 [..., n] -> uint8 [..., 2n]: each byte's low nibble, then its high one."""

    def blocks_to_f32(self, q: Value, offset: int, scales: Value) -> Value:
        """(q [..., nb, 32] unsigned - offset) * scales [..., nb] -> float32 [..., nb * 32]."""

    def qk(self, q: Value, k: Value) -> Value:
        """q [B, KV, G, T, D] . k [B, KV, L, D] -> scores [B, KV, G, T, L] (batched over B, KV)."""

    def pv(self, p: Value, v: Value) -> Value:
        """p [B, KV, G, T, L] . v [B, KV, L, D] -> [B, KV, G, T, D] (batched over B, KV)."""


def rms_norm(m: MathBuilder, x: Value, weight: Value, eps: float) -> Value:
    """x / rms(x) * weight over the last axis; the statistics in float32, as the reference."""
    x32 = m.to_f32(x)
    inv = m.rsqrt(m.add(m.mean_last(m.mul(x32, x32)), m.scalar(eps, "f32")))
    return m.mul(weight, m.to_act(m.mul(x32, inv)))


def rope_table(m: MathBuilder, pos: Value, inv_freq: Sequence[float]) -> tuple[Value, Value]:
    """cos, sin [B, T, rot] in the compute dtype for positions [B, T]; angles in float32."""
    angles = m.mul(m.unsqueeze(m.index_to_f32(pos), [2]), m.f32_array(inv_freq))  # [B, T, rot/2]
    emb = m.concat_last([angles, angles])  # [B, T, rot]
    return m.to_act(m.cos(emb)), m.to_act(m.sin(emb))


def rope(m: MathBuilder, x: Value, cos: Value, sin: Value, rot: int, head_dim: int) -> Value:
    """Rotate-half rope on the first `rot` features of each head; x [B, T, heads, D]."""
    c, s = m.unsqueeze(cos, [2]), m.unsqueeze(sin, [2])  # [B, T, 1, rot]: broadcast over heads
    x_rot = m.slice_last(x, 0, rot) if rot < head_dim else x
    half = rot // 2
    rotated = m.concat_last([m.neg(m.slice_last(x_rot, half, rot)), m.slice_last(x_rot, 0, half)])
    out = m.add(m.mul(x_rot, c), m.mul(rotated, s))
    return m.concat_last([out, m.slice_last(x, rot, head_dim)]) if rot < head_dim else out


def attention_bias(m: MathBuilder, q_pos: Value, key_pos: Value, window: int | None) -> Value:
    """Additive float32 mask [B, 1, 1, T, L]: 0 where query position q_pos [B, T] may see key
    position key_pos [L] (causal, within the window), -inf elsewhere. Causality also hides cache
    entries past a row's own positions, stale from an earlier request."""
    q = m.unsqueeze(q_pos, [2])  # [B, T, 1]
    allowed = m.le(key_pos, q)
    if window is not None:
        allowed = m.and_(allowed, m.gt(key_pos, m.sub(q, m.scalar(window, "index"))))
    bias = m.where(allowed, m.scalar(0.0, "f32"), m.scalar(-math.inf, "f32"))  # [B, T, L]
    return m.unsqueeze(bias, [1, 2])


def attend(m: MathBuilder, q: Value, keys: Value, values: Value, bias: Value, scale: float,
           softcap: float | None = None) -> Value:
    """q [B, KV, G, T, D] over keys, values [B, KV, L, D] -> [B, KV, G, T, D]; scores (soft-capped where
    `softcap` is given), mask and softmax in float32, as the reference computes them."""
    scores = m.mul(m.to_f32(m.qk(q, keys)), m.scalar(scale, "f32"))
    if softcap is not None:
        scores = capped(m, scores, softcap)
    return m.pv(m.to_act(m.softmax_last(m.add(scores, bias))), values)


def capped(m: MathBuilder, x32: Value, cap: float) -> Value:
    """cap * tanh(x / cap) of a float32 value."""
    return m.mul(m.scalar(cap, "f32"), m.tanh(m.mul(x32, m.scalar(1.0 / cap, "f32"))))


def softcap(m: MathBuilder, x: Value, cap: float) -> Value:
    """cap * tanh(x / cap) in float32, back in the compute dtype."""
    return m.to_act(capped(m, m.to_f32(x), cap))


def scale(m: MathBuilder, x: Value, factor: float) -> Value:
    """x * factor with the product in float32, as PyTorch multiplies a 16-bit tensor by a Python float."""
    return m.to_act(m.mul(m.to_f32(x), m.scalar(factor, "f32")))


def silu(m: MathBuilder, x: Value) -> Value:
    return m.mul(x, m.sigmoid(x))


def gelu(m: MathBuilder, x: Value, approximate: str) -> Value:
    """0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) for "tanh", else 0.5 x (1 + erf(x / sqrt 2))."""
    if approximate == "tanh":
        cube = m.mul(x, m.mul(x, x))
        inner = m.mul(m.scalar(math.sqrt(2 / math.pi), "act"), m.add(x, m.mul(m.scalar(0.044715, "act"), cube)))
        gate = m.add(m.scalar(1.0, "act"), m.tanh(inner))
    else:
        gate = m.add(m.scalar(1.0, "act"), m.erf(m.mul(x, m.scalar(math.sqrt(0.5), "act"))))
    return m.mul(m.mul(x, m.scalar(0.5, "act")), gate)


def activation(m: MathBuilder, x: Value, act: str) -> Value:
    """The experts' activation by name (ops.ACTIVATIONS)."""
    return silu(m, x) if act == "silu" else gelu(m, x, "tanh" if act == "gelu_tanh" else "none")


def route(m: MathBuilder, logits: Value, count: int, top_k: int, normalize: bool) -> Value:
    """Each expert's weight [..., E] from a router's logits: softmax in float32, the top_k kept (by
    top_k rounds of the largest left, the lower expert first on ties), renormalized where asked."""
    probs = m.softmax_last(m.to_f32(logits))
    number = m.f32_array([float(e) for e in range(count)])  # each expert's index, as float32 [E]
    kept, left = m.mul(probs, m.scalar(0.0, "f32")), probs
    for _ in range(top_k):
        top = m.max_last(left)  # [..., 1]
        first = m.neg(m.max_last(m.neg(m.where(m.le(top, left), number, m.scalar(count, "f32")))))
        hit = m.and_(m.le(number, first), m.le(first, number))  # [..., E]: the one expert taken this round
        kept = m.where(hit, probs, kept)
        left = m.where(hit, m.scalar(-1.0, "f32"), left)
    if normalize:
        kept = m.div(kept, m.sum_last(kept))
    return m.to_act(kept)


def dequantize(b: MathBuilder, values: Value, scales: Value, bits: int) -> Value:
    """Block-quantized weights in MatMulNBits' layout (quant.nbits_layout) to float32, in the graph:
    values uint8 [..., nb, 32 * bits / 8], scales float32 [..., nb] -> [..., nb * 32]."""
    q = b.nibbles(values) if bits == 4 else values  # [..., nb, 32]
    return b.blocks_to_f32(q, 1 << (bits - 1), scales)
