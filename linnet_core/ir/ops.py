"""The closed op set of the Linnet IR, with the shape rule of each op.

Shapes are tuples of ints and symbols: "B" (rows in the step), "T" (tokens per row), "T'"
(T, or 1 when only the last position's logits are wanted); a ragged step (ir.ragged) has "N"
tokens from any mix of rows and "E" entries whose logits are wanted. The builder infers output
shapes with these rules and the verifier re-checks them, so a backend can trust every shape it
reads. Each op also carries a numpy reference (ir.numpy_ops), which the conformance tests run
every emitter against.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

from ..errors import IRError
from .numpy_ops import REFERENCES

Shape = tuple  # of int | str


def _same(*shapes: Shape) -> None:
    if len(set(shapes)) != 1:
        raise IRError(f"shapes differ: {', '.join(map(str, shapes))}")


def _positions(start: Shape, ids: Shape) -> list[Shape]:
    _same(start[:1], ids[:1])
    return [ids]


def _rope_table(pos: Shape, *, rotary_dim: int, **_) -> list[Shape]:
    return [pos + (rotary_dim,), pos + (rotary_dim,)]


def _embedding(ids: Shape, table: Shape) -> list[Shape]:
    return [ids + (table[1],)]


def _rms_norm(x: Shape, weight: Shape, *, eps: float) -> list[Shape]:
    _same(x[-1:], weight)
    return [x]


def _linear(x: Shape, weight: Shape, bias: Shape | None = None) -> list[Shape]:
    if x[-1] != weight[1]:
        raise IRError(f"linear: input features {x[-1]} != weight columns {weight[1]}")
    if bias is not None:
        _same(bias, weight[:1])
    return [x[:-1] + (weight[0],)]


def _split(x: Shape, *, sizes: list[int]) -> list[Shape]:
    if sum(sizes) != x[-1]:
        raise IRError(f"split: sizes {sizes} do not add up to {x[-1]}")
    return [x[:-1] + (s,) for s in sizes]


def _reshape(x: Shape, *, shape: list) -> list[Shape]:
    def numel(s: Shape) -> tuple:
        ints = [d for d in s if isinstance(d, int)]
        prod = 1
        for d in ints:
            prod *= d
        return prod, sorted(d for d in s if isinstance(d, str))

    if numel(x) != numel(tuple(shape)):
        raise IRError(f"reshape: {x} cannot become {tuple(shape)}")
    return [tuple(shape)]


def _rope(x: Shape, cos: Shape, sin: Shape, *, apply) -> list[Shape]:
    _same(cos, sin)
    _same(x[:2], cos[:2])
    if cos[-1] > x[-1] or cos[-1] % 2:
        raise IRError(f"rope: rotary dim {cos[-1]} does not fit head dim {x[-1]}")
    return [x]


RAGGED_INDEX = 6  # d_slots, d_kv_len, p_slots, p_index, p_pack, p_kv_len (see ir.ragged)


def _attention(q: Shape, k: Shape, v: Shape, pos: Shape, slots: Shape, *index: Shape, scale: float, window,
               softcap, ragged: bool) -> list[Shape]:
    _same(k, v)
    _same(q[:2], k[:2], pos)
    _same(q[-1:], k[-1:])
    if q[2] % k[2]:
        raise IRError(f"attention: {q[2]} query heads do not group over {k[2]} KV heads")
    if not ragged:
        if index:
            raise IRError("attention: a dense step takes 5 inputs")
        _same(slots, q[:1])
        return [q]
    if len(index) != RAGGED_INDEX or q[0] != 1:
        raise IRError(f"attention: a ragged step takes q [1, N, ...] and {5 + RAGGED_INDEX} inputs")
    d_slots, d_kv_len, p_slots, p_index, p_pack, p_kv_len = index
    _same(slots, pos)
    _same(d_kv_len, p_kv_len, (1,))
    _same(p_slots, p_index[:1])
    if len(d_slots) != 1 or len(p_pack) != 1 or len(p_index) != 2:
        raise IRError("attention: d_slots and p_pack are 1-D, p_index is [Bp, Tp]")
    return [q]


def _unary(x: Shape, **_) -> list[Shape]:
    return [x]


def _pick(*xs: Shape, index: int) -> list[Shape]:
    _same(*xs)
    if not 0 <= index < len(xs):
        raise IRError(f"pick: index {index} of {len(xs)} inputs")
    return [xs[0]]


def _route(logits: Shape, *, top_k: int, normalize: bool) -> list[Shape]:
    if not isinstance(logits[-1], int) or not 1 <= top_k <= logits[-1]:
        raise IRError(f"top_k {top_k} of {logits[-1]} experts")
    return [logits]


def _experts(x: Shape, weights: Shape, gate: Shape, up: Shape, down: Shape, *, top_k: int, act: str) -> list[Shape]:
    _same(x[:-1], weights[:-1])
    _same(gate, up)
    count, hidden = weights[-1], x[-1]
    if gate[1] != hidden or gate[0] % count or down != (count * hidden, gate[0] // count):
        raise IRError(f"expert weights gate {gate}, down {down} do not stack {count} experts of width {hidden}")
    if act not in ACTIVATIONS:
        raise IRError(f"activation '{act}' (known: {', '.join(ACTIVATIONS)})")
    return [x]


ACTIVATIONS = ("silu", "gelu", "gelu_tanh")


def _binary(a: Shape, b: Shape) -> list[Shape]:
    _same(a, b)
    return [a]


def _last_token(x: Shape, logits_index: Shape | None = None, *, ragged: bool) -> list[Shape]:
    if ragged:  # [1, N, ...] -> [E, 1, ...]: the tokens logits_index names
        if logits_index is None or len(logits_index) != 1 or x[0] != 1:
            raise IRError("last_token: a ragged step takes x [1, N, ...] and logits_index [E]")
        return [(logits_index[0], 1) + x[2:]]
    if x[1] != "T" or logits_index is not None:
        raise IRError("last_token: expects [B, T, ...]")
    return [(x[0], "T'") + x[2:]]


def _argmax(logits: Shape) -> list[Shape]:
    return [logits[:1]]


@dataclass(frozen=True)
class OpDef:
    infer: Callable[..., list[Shape]]
    inputs: int  # required inputs
    optional: int = 0  # trailing optional inputs
    attrs: tuple[str, ...] = ()
    in_block_only: bool = False
    doc: str = ""
    defaults: dict = field(default_factory=dict)  # attributes a node may leave out, with their values
    out_dtype: str = "act"  # the dtype of every output: "act" (the compile dtype) or "i64"
    reference: Callable | None = None  # what the op means, in numpy (ir.numpy_ops)
    matrices: tuple[int, ...] = ()  # inputs that are weight matrices [out, in] multiplied as a linear's


OPS: dict[str, OpDef] = {
    "positions": OpDef(_positions, 2, doc="absolute positions [B,T] = start[:,None] + arange(T)", out_dtype="i64"),
    "rope_table": OpDef(_rope_table, 1, attrs=("rope", "rotary_dim"), doc="cos, sin [B,T,rot] for positions"),
    "embedding": OpDef(_embedding, 2, doc="row lookup of token ids in a table"),
    "rms_norm": OpDef(_rms_norm, 2, attrs=("eps",), doc="x / rms(x) * weight over the last axis, in float32"),
    "linear": OpDef(_linear, 2, optional=1, doc="x @ weight.T (+ bias)", matrices=(1,)),
    "split": OpDef(_split, 1, attrs=("sizes",), doc="split the last axis"),
    "reshape": OpDef(_reshape, 1, attrs=("shape",), doc="reshape (symbols B and T kept)"),
    "rope": OpDef(_rope, 3, attrs=("apply",), defaults={"apply": True},
                  doc="rotate the first rotary_dim features of each head (rotate-half layout); "
                      "on a layer whose `apply` is false, x unchanged (a per-layer attribute: NoPE layers)"),
    "attention": OpDef(
        _attention, 5, optional=RAGGED_INDEX, attrs=("scale", "window", "softcap", "ragged"), in_block_only=True,
        defaults={"window": None, "softcap": None, "ragged": False},
        doc="write k, v into this layer's cache rows at pos, attend causally (GQA, optional window; "
            "softcap: scores become cap * tanh(scores / cap) before the mask); "
            "ragged: the step's tokens from many rows, attended in two groups (see ir.ragged)",
    ),
    "silu": OpDef(_unary, 1),
    "gelu": OpDef(_unary, 1, attrs=("approximate",)),
    "mul": OpDef(_binary, 2),
    "scale": OpDef(_unary, 1, attrs=("factor",), doc="x * factor, a constant of the model's config, in float32"),
    "softcap": OpDef(_unary, 1, attrs=("cap",), doc="cap * tanh(x / cap), in float32: logits held below cap"),
    "pick": OpDef(_pick, 2, optional=2, attrs=("index",),
                  doc="the input numbered `index` (a per-layer attribute: each layer's own rope table)"),
    "add": OpDef(_binary, 2),
    "route": OpDef(_route, 1, attrs=("top_k", "normalize"),
                   doc="a router's logits [..., E] -> each expert's weight [..., E]: softmax in float32, the top_k "
                       "largest kept (the lower expert first on ties), the rest 0; normalize: the kept sum to 1"),
    "experts": OpDef(_experts, 5, attrs=("top_k", "act"), matrices=(2, 3, 4),
                     doc="x [..., H] through the experts its weights [..., E] name (at most top_k each), summed by "
                         "weight: down_e(act(gate_e x) * up_e x); gate, up [E*F, H] and down [E*H, F] stack the "
                         "experts' matrices by rows (expert e's are rows e*F.. of gate and up, e*H.. of down)"),
    "last_token": OpDef(_last_token, 1, optional=1, attrs=("ragged",), defaults={"ragged": False},
                        doc="x[:, -1:] unless all positions' logits are asked for; ragged: x[0, logits_index, None]"),
    "argmax": OpDef(_argmax, 1, doc="greedy next token from the last position's logits", out_dtype="i64"),
}


# Every op carries its numpy reference; an op without one is refused here, at import.
OPS = {name: replace(d, reference=REFERENCES[name]) for name, d in OPS.items()}


def matrix_inputs(nodes) -> set[str]:
    """The names of the weight matrices `nodes` multiply (linear weights, experts' stacks), except a
    router's: its logits choose the experts, so it stays in the compute dtype (llama.cpp's quantizer
    keeps ffn_gate_inp in float too)."""
    routed = {n.inputs[0] for n in nodes if n.op == "route"}
    return {n.inputs[i] for n in nodes for i in OPS[n.op].matrices
            if not (n.op == "linear" and n.outputs[0] in routed)}


def infer(op: str, shapes: list[Shape], attrs: dict) -> list[Shape]:
    """Output shapes of `op`; raises IRError naming the op when the inputs do not fit."""
    if op not in OPS:
        raise IRError(f"unknown op '{op}' (the IR has: {', '.join(OPS)})")
    d = OPS[op]
    if not d.inputs <= len(shapes) <= d.inputs + d.optional:
        raise IRError(f"{op}: takes {d.inputs} inputs, got {len(shapes)}")
    attrs = {**d.defaults, **attrs}
    missing = [a for a in d.attrs if a not in attrs]
    if missing:
        raise IRError(f"{op}: missing attribute(s) {', '.join(missing)}")
    unknown = [a for a in attrs if a not in d.attrs]
    if unknown:
        raise IRError(f"{op}: unknown attribute(s) {', '.join(unknown)}")
    try:
        return d.infer(*shapes, **{k: attrs[k] for k in d.attrs})
    except IRError as e:
        raise IRError(f"{op}: {e.message}") from None
