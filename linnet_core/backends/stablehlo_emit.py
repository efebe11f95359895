"""Emitter: Linnet IR -> StableHLO text, directly (not by lowering the generated JAX).

One module per static shape: B rows of T tokens (prompts padded to buckets, `last` names the
real last position) and whether all positions' logits are returned. `@main` takes every weight,
the whole KV cache `[L, rows, KV, S, D]` (donated: `tf.aliasing_output`, so XLA updates it in
place), ids, start, slots and last; it returns the next tokens, the logits and the cache.
Every op is printed in MLIR's generic form, which every StableHLO release parses the same way.
Each IR op lowers through one function in LOWERINGS (the math through backends.decompose, which
`Module` implements the primitives of); a missing one fails at emit, naming it. Dense steps only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from ..dtypes import FORMATS, compute_dtype
from ..errors import IRError
from ..ir.graph import Graph, Node
from ..ir.rope import inv_freq
from ..ir.verify import verify
from ..quant import NBITS, nbits_shapes, param_formats
from . import decompose
from .lowering import Lowering

NEG_INF_F32 = "0xFF800000"


@dataclass(frozen=True)
class V:
    """An SSA value: its name, static shape and element type."""

    name: str
    shape: tuple[int, ...]
    et: str

    @property
    def ty(self) -> str:
        return tensor_type(self.shape, self.et)


def tensor_type(shape, et: str) -> str:
    return "tensor<" + "".join(f"{d}x" for d in shape) + et + ">"


def _ints(values) -> str:
    return "array<i64" + (": " + ", ".join(str(int(v)) for v in values) if len(values) else "") + ">"


def _float(v: float) -> str:
    return f"{float(v):.9e}"


class Module:
    """Prints StableHLO ops (generic form) with fresh SSA names; implements decompose.MathBuilder
    (numpy-style broadcasting through broadcast_in_dim) over activations of element type `act`."""

    def __init__(self, act: str = "f32"):
        self.lines: list[str] = []
        self._n = 0
        self.act = act

    def _fresh(self) -> str:
        self._n += 1
        return f"%v{self._n}"

    def op(self, name: str, args: list[V], shape, et: str, attrs: str = "", region: str = "") -> V:
        out = V(self._fresh(), tuple(shape), et)
        arg_names = ", ".join(a.name for a in args)
        arg_types = ", ".join(a.ty for a in args)
        attrs = f" {{{attrs}}}" if attrs else ""
        region = f" ({region})" if region else ""
        self.lines.append(f'    {out.name} = "stablehlo.{name}"({arg_names}){region}{attrs} : ({arg_types}) -> {out.ty}')
        return out

    # -- elementwise -------------------------------------------------------------------------
    def binary(self, name: str, a: V, b: V) -> V:
        return self.op(name, [a, b], a.shape, a.et)

    def unary(self, name: str, a: V) -> V:
        return self.op(name, [a], a.shape, a.et)

    def convert(self, a: V, et: str) -> V:
        return a if a.et == et else self.op("convert", [a], a.shape, et)

    # -- constants and shapes ----------------------------------------------------------------
    def const(self, value, et: str, shape=()) -> V:
        """A scalar broadcast to `shape` (float constants are made in f32, then converted)."""
        make_et = "f32" if et in ("f16", "bf16") else et
        if isinstance(value, str):
            literal = value
        elif make_et.startswith("f"):
            literal = _float(value)
        else:
            literal = str(int(value))
        out = V(self._fresh(), (), make_et)
        self.lines.append(f'    {out.name} = "stablehlo.constant"() {{value = dense<{literal}> : {out.ty}}} : () -> {out.ty}')
        out = self.convert(out, et)
        return self.broadcast(out, shape, []) if shape else out

    def array(self, values: list[float], et: str = "f32") -> V:
        out = V(self._fresh(), (len(values),), et)
        literal = "[" + ", ".join(_float(v) for v in values) + "]"
        self.lines.append(f'    {out.name} = "stablehlo.constant"() {{value = dense<{literal}> : {out.ty}}} : () -> {out.ty}')
        return out

    def broadcast(self, a: V, shape, dims) -> V:
        return self.op("broadcast_in_dim", [a], shape, a.et, f"broadcast_dimensions = {_ints(dims)}")

    def reshape(self, a: V, shape) -> V:
        return a if tuple(shape) == a.shape else self.op("reshape", [a], shape, a.et)

    def transpose(self, a: V, perm) -> V:
        return self.op("transpose", [a], [a.shape[p] for p in perm], a.et, f"permutation = {_ints(perm)}")

    def slice_last(self, a: V, lo: int, hi: int) -> V:
        start = [0] * (len(a.shape) - 1) + [lo]
        limit = list(a.shape[:-1]) + [hi]
        return self.op("slice", [a], a.shape[:-1] + (hi - lo,), a.et,
                       f"start_indices = {_ints(start)}, limit_indices = {_ints(limit)}, "
                       f"strides = {_ints([1] * len(a.shape))}")

    def concat(self, parts: list[V], dim: int) -> V:
        shape = list(parts[0].shape)
        shape[dim] = sum(p.shape[dim] for p in parts)
        return self.op("concatenate", parts, shape, parts[0].et, f"dimension = {dim} : i64")

    def iota(self, shape, dim: int, et: str = "i32") -> V:
        out = V(self._fresh(), tuple(shape), et)
        self.lines.append(f'    {out.name} = "stablehlo.iota"() {{iota_dimension = {dim} : i64}} : () -> {out.ty}')
        return out

    def dot(self, a: V, b: V, batch: tuple[list, list], contract: tuple[list, list], shape, et: str | None = None) -> V:
        dn = (f"#stablehlo.dot<lhs_batching_dimensions = [{', '.join(map(str, batch[0]))}], "
              f"rhs_batching_dimensions = [{', '.join(map(str, batch[1]))}], "
              f"lhs_contracting_dimensions = [{', '.join(map(str, contract[0]))}], "
              f"rhs_contracting_dimensions = [{', '.join(map(str, contract[1]))}]>")
        # HIGHEST for float32: XLA's GPU default runs float32 dots in TF32 (a 10-bit mantissa)
        highest = ", precision_config = [#stablehlo<precision HIGHEST>, #stablehlo<precision HIGHEST>]"
        attrs = f"dot_dimension_numbers = {dn}" + (highest if a.et == b.et == "f32" else "")
        return self.op("dot_general", [a, b], shape, et or a.et, attrs)

    def reduce(self, a: V, dims: list[int], kind: str) -> V:
        """Sum ("add") or maximum ("maximum") over `dims`."""
        init = self.const(0.0 if kind == "add" else NEG_INF_F32, a.et) if a.et.startswith("f") else self.const(0, a.et)
        s = tensor_type((), a.et)
        region = (f'{{\n    ^bb0(%acc: {s}, %x: {s}):\n      %r = "stablehlo.{kind}"(%acc, %x) : ({s}, {s}) -> {s}\n'
                  f'      "stablehlo.return"(%r) : ({s}) -> ()\n    }}')
        shape = [d for i, d in enumerate(a.shape) if i not in dims]
        return self.op("reduce", [a, init], shape, a.et, f"dimensions = {_ints(dims)}", region)

    def argmax_last(self, a: V) -> V:
        """Index of the largest value over the last axis (the first of equals), as i32."""
        axis = len(a.shape) - 1
        idx = self.iota(a.shape, axis)
        f, i = tensor_type((), a.et), tensor_type((), "i32")
        ninf, zero = self.const(NEG_INF_F32, "f32"), self.const(0, "i32")
        ninf = self.convert(ninf, a.et)
        region = (
            f"{{\n    ^bb0(%a: {f}, %ai: {i}, %b: {f}, %bi: {i}):\n"
            f'      %gt = "stablehlo.compare"(%a, %b) {{comparison_direction = #stablehlo<comparison_direction GT>}} : ({f}, {f}) -> tensor<i1>\n'
            f'      %eq = "stablehlo.compare"(%a, %b) {{comparison_direction = #stablehlo<comparison_direction EQ>}} : ({f}, {f}) -> tensor<i1>\n'
            f'      %lt = "stablehlo.compare"(%ai, %bi) {{comparison_direction = #stablehlo<comparison_direction LT>}} : ({i}, {i}) -> tensor<i1>\n'
            f'      %tie = "stablehlo.and"(%eq, %lt) : (tensor<i1>, tensor<i1>) -> tensor<i1>\n'
            f'      %keep = "stablehlo.or"(%gt, %tie) : (tensor<i1>, tensor<i1>) -> tensor<i1>\n'
            f'      %v = "stablehlo.select"(%keep, %a, %b) : (tensor<i1>, {f}, {f}) -> {f}\n'
            f'      %k = "stablehlo.select"(%keep, %ai, %bi) : (tensor<i1>, {i}, {i}) -> {i}\n'
            f'      "stablehlo.return"(%v, %k) : ({f}, {i}) -> ()\n    }}'
        )
        name = self._fresh()
        shape = a.shape[:-1]
        vt, it = tensor_type(shape, a.et), tensor_type(shape, "i32")
        self.lines.append(
            f'    {name}:2 = "stablehlo.reduce"({a.name}, {idx.name}, {ninf.name}, {zero.name}) ({region}) '
            f"{{dimensions = {_ints([axis])}}} : ({a.ty}, {idx.ty}, {ninf.ty}, {zero.ty}) -> ({vt}, {it})"
        )
        return V(f"{name}#1", shape, "i32")

    def gather_rows(self, table: V, indices: V, index_dims: list[int]) -> V:
        """table[indices[..., 0], indices[..., 1], ...] over the leading `index_dims` of table.

        indices [..., len(index_dims)] i32; out-of-range indices are clamped (XLA's rule).
        """
        batch = indices.shape[:-1]
        rest = [d for i, d in enumerate(table.shape) if i not in index_dims]
        offset_dims = list(range(len(batch), len(batch) + len(rest)))
        sizes = [1 if i in index_dims else d for i, d in enumerate(table.shape)]
        dn = (f"#stablehlo.gather<offset_dims = [{', '.join(map(str, offset_dims))}], "
              f"collapsed_slice_dims = [{', '.join(map(str, index_dims))}], "
              f"start_index_map = [{', '.join(map(str, index_dims))}], index_vector_dim = {len(batch)}>")
        return self.op("gather", [table, indices], list(batch) + rest, table.et,
                       f"dimension_numbers = {dn}, slice_sizes = {_ints(sizes)}, indices_are_sorted = false")

    def scatter_set(self, operand: V, indices: V, updates: V, index_dims: list[int]) -> V:
        """operand with updates written at indices (over `index_dims`); out-of-range ones skipped."""
        s = tensor_type((), operand.et)
        region = (f'{{\n    ^bb0(%old: {s}, %new: {s}):\n      "stablehlo.return"(%new) : ({s}) -> ()\n    }}')
        n_batch = len(indices.shape) - 1
        window = list(range(n_batch, len(updates.shape)))
        dn = (f"#stablehlo.scatter<update_window_dims = [{', '.join(map(str, window))}], "
              f"inserted_window_dims = [{', '.join(map(str, index_dims))}], "
              f"scatter_dims_to_operand_dims = [{', '.join(map(str, index_dims))}], index_vector_dim = {n_batch}>")
        return self.op("scatter", [operand, indices, updates], operand.shape, operand.et,
                       f"scatter_dimension_numbers = {dn}, indices_are_sorted = false, unique_indices = false", region)


    # -- decompose.MathBuilder -------------------------------------------------------------
    def nibbles(self, a: V) -> V:
        parts = [self.reshape(self.op(name, [a, self.const(k, a.et, a.shape)], a.shape, a.et), a.shape + (1,))
                 for name, k in (("and", 0x0F), ("shift_right_logical", 4))]  # low, high: [..., n, 1]
        return self.reshape(self.concat(parts, len(a.shape)), a.shape[:-1] + (2 * a.shape[-1],))

    def blocks_to_f32(self, q: V, offset: int, scales: V) -> V:
        centered = self.binary("subtract", self.convert(q, "f32"), self.const(offset, "f32", q.shape))
        w = self.binary("multiply", centered, self.broadcast(scales, q.shape, list(range(len(scales.shape)))))
        return self.reshape(w, q.shape[:-2] + (q.shape[-2] * q.shape[-1],))

    def _to_shape(self, a: V, shape: tuple) -> V:
        if a.shape == tuple(shape):
            return a
        return self.broadcast(a, shape, list(range(len(shape) - len(a.shape), len(shape))))

    def _elementwise(self, name: str, args: list[V], et: str | None = None, attrs: str = "") -> V:
        shape = tuple(np.broadcast_shapes(*(a.shape for a in args)))
        return self.op(name, [self._to_shape(a, shape) for a in args], shape, et or args[-1].et, attrs)

    def add(self, a: V, b: V) -> V:
        return self._elementwise("add", [a, b])

    def sub(self, a: V, b: V) -> V:
        return self._elementwise("subtract", [a, b])

    def mul(self, a: V, b: V) -> V:
        return self._elementwise("multiply", [a, b])

    def div(self, a: V, b: V) -> V:
        return self._elementwise("divide", [a, b])

    def neg(self, a: V) -> V:
        return self.unary("negate", a)

    def rsqrt(self, a: V) -> V:
        return self.unary("rsqrt", a)

    def cos(self, a: V) -> V:
        return self.unary("cosine", a)

    def sin(self, a: V) -> V:
        return self.unary("sine", a)

    def tanh(self, a: V) -> V:
        return self.unary("tanh", a)

    def sigmoid(self, a: V) -> V:
        return self.unary("logistic", a)

    def erf(self, a: V) -> V:
        out = V(self._fresh(), a.shape, a.et)
        self.lines.append(f'    {out.name} = "chlo.erf"({a.name}) : ({a.ty}) -> {out.ty}')
        return out

    def le(self, a: V, b: V) -> V:
        return self._elementwise("compare", [a, b], "i1", "comparison_direction = #stablehlo<comparison_direction LE>")

    def gt(self, a: V, b: V) -> V:
        return self._elementwise("compare", [a, b], "i1", "comparison_direction = #stablehlo<comparison_direction GT>")

    def and_(self, a: V, b: V) -> V:
        return self._elementwise("and", [a, b])

    def where(self, cond: V, a: V, b: V) -> V:
        return self._elementwise("select", [cond, a, b])

    def scalar(self, value: float, kind: str) -> V:
        if kind == "index":
            return self.const(int(value), "i32")
        et = "f32" if kind == "f32" else self.act
        return self.const(NEG_INF_F32 if value == -math.inf else value, et)

    def f32_array(self, values: Sequence[float]) -> V:
        return self.array(list(values))

    def to_f32(self, a: V) -> V:
        return self.convert(a, "f32")

    def index_to_f32(self, a: V) -> V:
        return self.convert(a, "f32")

    def to_act(self, a: V) -> V:
        return self.convert(a, self.act)

    def _keep_last(self, a: V, kind: str) -> V:
        reduced = self.reduce(a, [len(a.shape) - 1], kind)
        return self.reshape(reduced, a.shape[:-1] + (1,))

    def mean_last(self, a: V) -> V:
        return self.div(self._keep_last(a, "add"), self.const(a.shape[-1], a.et))

    def sum_last(self, a: V) -> V:
        return self._keep_last(a, "add")

    def max_last(self, a: V) -> V:
        return self._keep_last(a, "maximum")

    def softmax_last(self, a: V) -> V:
        e = self.unary("exponential", self.sub(a, self._keep_last(a, "maximum")))
        return self.div(e, self._keep_last(e, "add"))

    def concat_last(self, parts: list[V]) -> V:
        return self.concat(parts, len(parts[0].shape) - 1)

    def unsqueeze(self, a: V, axes: list[int]) -> V:
        shape = list(a.shape)
        for axis in sorted(axes):
            shape.insert(axis, 1)
        return self.reshape(a, shape)

    def qk(self, q: V, k: V) -> V:
        # scores come out of the dot in float32, unrounded, as SDPA's and the reference's do
        return self.dot(q, k, ([0, 1], [0, 1]), ([4], [3]), q.shape[:4] + (k.shape[2],), et="f32")

    def pv(self, p: V, v: V) -> V:
        return self.dot(p, v, ([0, 1], [0, 1]), ([4], [2]), p.shape[:4] + (v.shape[3],))


class _Lowering(Lowering):
    """State shared by the StableHLO op lowerings of one module (env holds SSA values)."""

    emitter = "StableHLO"

    def __init__(self, g: Graph, m: Module, act: str, B: int, T: int, all_logits: bool):
        super().__init__(g, LOWERINGS)
        self.m, self.act, self.B, self.T, self.all_logits = m, act, B, T, all_logits
        self.k_cache: V | None = None
        self.v_cache: V | None = None
        self.last: V | None = None
        self.biases: dict[object, V] = {}  # attention masks by window: one per graph

    def shape(self, ir_name: str) -> tuple[int, ...]:
        sub = {"B": self.B, "T": self.T, "T'": self.T if self.all_logits else 1}
        return tuple(sub.get(d, d) for d in self.g.values[ir_name].shape)


HloLowering = Callable[[_Lowering, Node, list[V]], list[V]]


@dataclass(frozen=True)
class Blocks:
    """A block-quantized weight's two arguments (quant.nbits_layout): values uint8 [N, nb, bytes]
    and float32 scales [N, nb]."""

    values: V
    scales: V
    bits: int


def _positions(L: _Lowering, n: Node, x: list[V]) -> list[V]:
    m = L.m
    steps = m.iota((L.B, L.T), 1)
    return [m.binary("add", steps, m.broadcast(x[0], (L.B, L.T), [0]))]


def _rope_table(L: _Lowering, n: Node, x: list[V]) -> list[V]:
    return list(decompose.rope_table(L.m, x[0], inv_freq(n.attrs["rope"], n.attrs["rotary_dim"])))


def _embedding(L: _Lowering, n: Node, x: list[V]) -> list[V]:
    ids = L.m.reshape(x[0], x[0].shape + (1,))
    table = x[1]
    if isinstance(table, Blocks):  # the rows' blocks, dequantized: [B, T, nb, bytes] -> [B, T, K]
        rows = [L.m.gather_rows(t, ids, [0]) for t in (table.values, table.scales)]
        return [L.m.convert(decompose.dequantize(L.m, *rows, table.bits), L.act)]
    return [L.m.gather_rows(table, ids, [0])]


def _matrix(m: Module, w) -> V:
    """A weight matrix as a value: block-quantized ones dequantized in the graph, where XLA can fuse
    it into the dot's operand ([N, K] float32)."""
    return decompose.dequantize(m, w.values, w.scales, w.bits) if isinstance(w, Blocks) else w


def _linear(L: _Lowering, n: Node, x: list[V]) -> list[V]:
    m = L.m
    a, w = x[0], _matrix(L.m, x[1])
    axis = len(a.shape) - 1
    y = m.dot(a, w, ([], []), ([axis], [1]), a.shape[:-1] + (w.shape[0],))
    return [m.binary("add", y, m.broadcast(x[2], y.shape, [axis])) if len(x) == 3 else y]


def _experts(L: _Lowering, n: Node, x: list[V]) -> list[V]:
    """Dense: every expert over every token, weight 0 where not chosen (static shapes, at E / top_k
    times the chosen experts' multiplications); the down projections as one dot batched over experts."""
    m = L.m
    h, weights, gate, up, down = x
    count, lead = weights.shape[-1], h.shape[:-1]
    gated = m.mul(decompose.activation(m, _linear(L, n, [h, gate])[0], n.attrs["act"]), _linear(L, n, [h, up])[0])
    width = gated.shape[-1] // count
    gated = m.mul(m.reshape(gated, lead + (count, width)), m.reshape(weights, lead + (count, 1)))  # [..., E, F]
    stacked = m.reshape(m.to_act(_matrix(m, down)), (count, h.shape[-1], width))  # [E, H, F]
    axis = len(lead)
    y = m.dot(gated, stacked, ([axis], [0]), ([axis + 1], [2]), (count,) + lead + (h.shape[-1],))  # [E, ..., H]
    return [m.reduce(y, [0], "add")]


def _split(L: _Lowering, n: Node, x: list[V]) -> list[V]:
    out, lo = [], 0
    for size in n.attrs["sizes"]:
        out.append(L.m.slice_last(x[0], lo, lo + size))
        lo += size
    return out


def _attention(L: _Lowering, n: Node, x: list[V]) -> list[V]:
    m = L.m
    q, k, v, pos, slots = x
    B, T, H, D = q.shape
    KV = k.shape[2]
    G = H // KV
    S = L.k_cache.shape[3]
    layer = m.const(L.layer, "i32", (B, T, 1))
    slot = m.reshape(m.broadcast(slots, (B, T), [0]), (B, T, 1))
    at = m.concat([layer, slot, m.reshape(pos, (B, T, 1))], 2)  # [B, T, 3]: (layer, row, position)
    L.k_cache = m.scatter_set(L.k_cache, at, k, [0, 1, 3])
    L.v_cache = m.scatter_set(L.v_cache, at, v, [0, 1, 3])
    rows = m.concat([m.const(L.layer, "i32", (B, 1)), m.reshape(slots, (B, 1))], 1)  # [B, 2]
    keys = m.gather_rows(L.k_cache, rows, [0, 1])  # [B, KV, S, D]
    values = m.gather_rows(L.v_cache, rows, [0, 1])
    window = L.attr(n, "window")
    if window not in L.biases:
        L.biases[window] = decompose.attention_bias(m, pos, m.iota((S,), 0), window)  # [B, 1, 1, T, S]
    q5 = m.transpose(m.reshape(q, (B, T, KV, G, D)), [0, 2, 3, 1, 4])  # [B, KV, G, T, D]
    out = decompose.attend(m, q5, keys, values, L.biases[window], L.attr(n, "scale"),
                           L.attr(n, "softcap"))  # [B, KV, G, T, D]
    return [m.reshape(m.transpose(out, [0, 3, 1, 2, 4]), (B, T, H, D))]


def _pick_position(L: _Lowering, a: V, position: V) -> V:
    """a[b, position[b]] for a [B, T, F] -> [B, F]."""
    m = L.m
    B = a.shape[0]
    rows = m.concat([m.iota((B, 1), 0), m.reshape(position, (B, 1))], 1)  # [B, 2]
    return m.gather_rows(a, rows, [0, 1])


def _last_token(L: _Lowering, n: Node, x: list[V]) -> list[V]:
    if L.all_logits:
        return [x[0]]
    a = x[0]
    return [L.m.reshape(_pick_position(L, a, L.last), (a.shape[0], 1, a.shape[2]))]


def _argmax(L: _Lowering, n: Node, x: list[V]) -> list[V]:
    a = x[0]
    position = L.last if L.all_logits else L.m.const(0, "i32", (a.shape[0],))
    return [L.m.argmax_last(_pick_position(L, a, position))]


LOWERINGS: dict[str, HloLowering] = {
    "positions": _positions,
    "rope_table": _rope_table,
    "embedding": _embedding,
    "rms_norm": lambda L, n, x: [decompose.rms_norm(L.m, x[0], x[1], n.attrs["eps"])],
    "linear": _linear,
    "split": _split,
    "reshape": lambda L, n, x: [L.m.reshape(x[0], L.shape(n.outputs[0]))],
    "rope": lambda L, n, x: [decompose.rope(L.m, *x, x[1].shape[-1], x[0].shape[-1])
                             if L.attr(n, "apply") else x[0]],
    "attention": _attention,
    "silu": lambda L, n, x: [decompose.silu(L.m, x[0])],
    "gelu": lambda L, n, x: [decompose.gelu(L.m, x[0], n.attrs["approximate"])],
    "mul": lambda L, n, x: [L.m.mul(*x)],
    "scale": lambda L, n, x: [decompose.scale(L.m, x[0], n.attrs["factor"])],
    "softcap": lambda L, n, x: [decompose.softcap(L.m, x[0], n.attrs["cap"])],
    "pick": lambda L, n, x: [x[L.attr(n, "index")]],
    "add": lambda L, n, x: [L.m.add(*x)],
    "route": lambda L, n, x: [decompose.route(L.m, x[0], x[0].shape[-1], n.attrs["top_k"], n.attrs["normalize"])],
    "experts": _experts,
    "last_token": _last_token,
    "argmax": _argmax,
}


def emit_stablehlo(graph: Graph, dtype: str, cache_len: int, rows: int, B: int, T: int, all_logits: bool) -> str:
    """The StableHLO module of one static step shape."""
    verify(graph)
    if graph.ragged:
        raise IRError("the StableHLO emitter has no ragged step form (it emits one module per dense step shape)")
    act = FORMATS[compute_dtype(dtype)].hlo
    m = Module(act)
    L = _Lowering(graph, m, act, B, T, all_logits)
    c = graph.cache
    args: list[str] = []
    formats = param_formats(graph, dtype)
    for full, p, _ in graph.all_params():  # the weights' arguments, as weight_arguments orders them
        if FORMATS[formats[full]].quantized:
            values_shape, scales_shape = nbits_shapes(*p.shape, formats[full])
            values = V(f"%w{len(args)}", values_shape, "ui8")
            scales = V(f"%w{len(args) + 1}", scales_shape, "f32")
            L.env[full] = Blocks(values, scales, NBITS[formats[full]])
            args += [f"{values.name}: {values.ty}", f"{scales.name}: {scales.ty}"]
        else:
            L.env[full] = V(f"%w{len(args)}", p.shape, act)
            args.append(f"{L.env[full].name}: {L.env[full].ty}")
    cache_shape = (c.layers, rows, c.kv_heads, cache_len, c.head_dim)
    L.k_cache, L.v_cache = V("%k_cache", cache_shape, act), V("%v_cache", cache_shape, act)
    args.append(f"%k_cache: {L.k_cache.ty} {{tf.aliasing_output = 2 : i32}}")
    args.append(f"%v_cache: {L.v_cache.ty} {{tf.aliasing_output = 3 : i32}}")
    for name, shape in (("ids", (B, T)), ("start", (B,)), ("slots", (B,)), ("last", (B,))):
        L.env[name] = V(f"%{name}", shape, "i32")
        args.append(f"%{name}: {L.env[name].ty}")
    L.last = L.env["last"]

    next_token, logits = L.run()
    results = [next_token, logits, L.k_cache, L.v_cache]
    spec = graph.meta.get("spec", {})
    head = [
        f"// Generated by Linnet from the IR of a {graph.meta.get('model_type')} checkpoint "
        f"({graph.block.count} layers, hidden {spec.get('hidden_size')}, vocab {spec.get('vocab_size')}).",
        f"// One step of B={B} rows x T={T} tokens{' (all logits)' if all_logits else ''}; "
        f"KV cache [{c.layers}, {rows}, {c.kv_heads}, {cache_len}, {c.head_dim}] {act}, donated.",
        "module @linnet_step {",
        f"  func.func public @main({', '.join(args)}) -> ({', '.join(r.ty for r in results)}) {{",
    ]
    tail = [f"    \"func.return\"({', '.join(r.name for r in results)}) : ({', '.join(r.ty for r in results)}) -> ()",
            "  }", "}"]
    return "\n".join(head + m.lines + tail) + "\n"
