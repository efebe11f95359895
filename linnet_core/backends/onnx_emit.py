"""Emitter: Linnet IR -> an ONNX model, written directly with `onnx` (no tracing).

One graph serves prefill and decode (dynamic B and T) over a static KV cache held as one input
and one output per layer and per K/V, `[rows, kv_heads, cache_len, head_dim]`: bind each output
to its input's buffer and ScatterND updates the cache in place. The next token is an output
(ArgMax in the graph), so a greedy step moves B integers to the host, never the logits.

A ragged graph (ir.ragged; ONNX Runtime's artifact) takes one step of N tokens from any mix of
rows: the linear layers run over the N tokens packed together, and attention runs twice, over
the one-token rows and over the multi-token chunks padded to one length. The dense form (B rows
of T tokens) is what TensorRT's builder and `linnet export onnx` take.

Weights are streamed to one external data file as they are prepared, so a model of any size is
emitted in bounded memory and stays under protobuf's 2 GB limit. Block-quantized weights (q8_0,
q4_0) lie there as MatMulNBits takes them (quant.nbits_layout: GGUF's weights, repacked). Each IR op lowers through one
function in LOWERINGS, the math through backends.decompose (whose primitives OnnxGraphBuilder
implements) or one of ONNX's own fused kernels; an op without a lowering fails at emit, naming it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch

from .. import __version__
from .. import params as prepared
from ..dtypes import FORMATS, ONNX_INT64, compute_dtype, torch_dtype
from ..errors import BackendUnavailable, IRError
from ..ir.graph import Graph, Node
from ..ir.ragged import RAGGED_INPUTS
from ..ir.rope import inv_freq
from ..ir.verify import verify
from ..quant import BLOCK, NBITS, nbits_layout, nbits_shapes, param_formats, quantize
from ..weight_store import Placer, fingerprint, write_here
from ..weights import Checkpoint
from . import decompose
from .lowering import Lowering

# The one place for what every emitted ONNX model declares (and ONNX Runtime's probes use).
OPSET = 23
IR_VERSION = 10  # what ONNX Runtime 1.20+ reads; opset 23 needs >= 10
MS_DOMAIN = "com.microsoft"  # ONNX Runtime's contrib ops: MatMulNBits for block-quantized weights
# MatMulNBits' compute: level 4 quantizes the activations to int8 blocks, as llama.cpp's q8_0 / q4_0
# dot products do. Level 0 (float32, exact over the stored weights) measured 7.9 tok/s against 160 on
# the 191M benchmark model: its CPU kernel dequantizes every 8-bit weight at every call.
NBITS_ACCURACY = {"q4_0": 4, "q8_0": 4}
INT64_MAX = np.iinfo(np.int64).max


def require_onnx():
    try:
        import onnx
    except ImportError:
        raise BackendUnavailable("the onnx package is not installed", hint="pip install 'linnet[onnx]'") from None
    return onnx


class OnnxGraphBuilder:
    """Collects nodes, constants and initializers; names are unique and readable."""

    def __init__(self, dtype: str):
        from onnx import helper

        self.helper = helper
        self.dtype = dtype
        self.nodes: list = []
        self.initializers: list = []
        self._consts: dict[tuple, str] = {}
        self._names: set[str] = set()
        self._unsqueezed: dict[tuple, str] = {}

    def fresh(self, base: str) -> str:
        name, k = base, 1
        while name in self._names:
            k += 1
            name = f"{base}_{k}"
        self._names.add(name)
        return name

    def const(self, value, dtype=np.int64, name: str = "c") -> str:
        """A small constant (deduplicated); large weights go through `weight`."""
        arr = np.asarray(value, dtype=dtype)
        key = (arr.dtype.str, arr.shape, arr.tobytes())
        if key not in self._consts:
            from onnx import numpy_helper

            cname = self.fresh(name)
            self.initializers.append(numpy_helper.from_array(arr, cname))
            self._consts[key] = cname
        return self._consts[key]

    def op(self, op_type: str, inputs: list[str], out: str | int = 1, domain: str = "", **attrs) -> str | list[str]:
        """Append a node; `out` is an output name, or a count of fresh outputs."""
        outs = [self.fresh(out)] if isinstance(out, str) else [self.fresh(op_type.lower()) for _ in range(out)]
        self.nodes.append(self.helper.make_node(op_type, inputs, outs, name=self.fresh(f"n_{op_type}"),
                                                domain=domain, **attrs))
        return outs[0] if len(outs) == 1 else outs

    def act_const(self, value: float, name: str = "c") -> str:
        """A scalar constant in the activation dtype (made by a Cast: numpy has no bfloat16)."""
        c = self.const(value, dtype=np.float32, name=name)
        if self.dtype == "float32":
            return c
        key = ("cast", c)
        if key not in self._consts:
            self._consts[key] = self.op("Cast", [c], to=FORMATS[self.dtype].onnx)
        return self._consts[key]

    # -- decompose.MathBuilder (ONNX broadcasts numpy-style itself) --------------------------
    def add(self, a: str, b: str) -> str:
        return self.op("Add", [a, b])

    def sub(self, a: str, b: str) -> str:
        return self.op("Sub", [a, b])

    def mul(self, a: str, b: str) -> str:
        return self.op("Mul", [a, b])

    def div(self, a: str, b: str) -> str:
        return self.op("Div", [a, b])

    def neg(self, a: str) -> str:
        return self.op("Neg", [a])

    def rsqrt(self, a: str) -> str:
        return self.op("Reciprocal", [self.op("Sqrt", [a])])

    def cos(self, a: str) -> str:
        return self.op("Cos", [a])

    def sin(self, a: str) -> str:
        return self.op("Sin", [a])

    def tanh(self, a: str) -> str:
        return self.op("Tanh", [a])

    def erf(self, a: str) -> str:
        return self.op("Erf", [a])

    def sigmoid(self, a: str) -> str:
        return self.op("Sigmoid", [a])

    def le(self, a: str, b: str) -> str:
        return self.op("LessOrEqual", [a, b])

    def gt(self, a: str, b: str) -> str:
        return self.op("Greater", [a, b])

    def and_(self, a: str, b: str) -> str:
        return self.op("And", [a, b])

    def where(self, cond: str, a: str, b: str) -> str:
        return self.op("Where", [cond, a, b])

    def scalar(self, value: float, kind: str) -> str:
        if kind == "index":
            return self.const(int(value))
        return self.const(value, np.float32) if kind == "f32" else self.act_const(value)

    def f32_array(self, values) -> str:
        return self.const(values, np.float32, "rope_inv_freq")

    def to_f32(self, a: str) -> str:
        return a if self.dtype == "float32" else self.op("Cast", [a], to=FORMATS["float32"].onnx)

    def index_to_f32(self, a: str) -> str:
        return self.op("Cast", [a], to=FORMATS["float32"].onnx)

    def to_act(self, a: str) -> str:
        return a if self.dtype == "float32" else self.op("Cast", [a], to=FORMATS[self.dtype].onnx)

    def mean_last(self, a: str) -> str:
        return self.op("ReduceMean", [a, self.const([-1])], keepdims=1)

    def sum_last(self, a: str) -> str:
        return self.op("ReduceSum", [a, self.const([-1])], keepdims=1)

    def max_last(self, a: str) -> str:
        return self.op("ReduceMax", [a, self.const([-1])], keepdims=1)

    def softmax_last(self, a: str) -> str:
        return self.op("Softmax", [a], axis=-1)

    def slice_last(self, a: str, lo: int, hi: int) -> str:
        return self.op("Slice", [a, self.const([lo]), self.const([hi]), self.const([-1])])

    def concat_last(self, parts: list[str]) -> str:
        return self.op("Concat", parts, axis=-1)

    def unsqueeze(self, a: str, axes: list[int]) -> str:
        key = (a, tuple(axes))  # made once: rope's cos and sin are unsqueezed by every layer
        if key not in self._unsqueezed:
            self._unsqueezed[key] = self.op("Unsqueeze", [a, self.const(list(axes))])
        return self._unsqueezed[key]

    def qk(self, q: str, k: str) -> str:
        return self.op("MatMul", [q, self.op("Transpose", [self.unsqueeze(k, [2])], perm=[0, 1, 2, 4, 3])])

    def merge_last_two(self, a: str) -> str:
        """[..., m, n] -> [..., m * n], whatever the rank."""
        head = self.op("Slice", [self.op("Shape", [a]), self.const([0]), self.const([-2])])
        return self.op("Reshape", [a, self.op("Concat", [head, self.const([-1])], axis=0)])

    def nibbles(self, a: str) -> str:
        low = self.op("BitwiseAnd", [a, self.const(0x0F, np.uint8)])
        high = self.op("BitShift", [a, self.const(4, np.uint8)], direction="RIGHT")
        return self.merge_last_two(self.op("Concat", [self.op("Unsqueeze", [x, self.const([-1])]) for x in (low, high)],
                                           axis=-1))

    def blocks_to_f32(self, q: str, offset: int, scales: str) -> str:
        centered = self.op("Sub", [self.op("Cast", [q], to=FORMATS["float32"].onnx), self.const(float(offset), np.float32)])
        return self.merge_last_two(self.op("Mul", [centered, self.op("Unsqueeze", [scales, self.const([-1])])]))

    def pv(self, p: str, v: str) -> str:
        return self.op("MatMul", [p, self.unsqueeze(v, [2])])


class _Lowering(Lowering):
    """State shared by the ONNX op lowerings of one graph (env holds ONNX value names)."""

    emitter = "ONNX"

    def __init__(self, g: Graph, b: OnnxGraphBuilder, dtype: str, cache_len: int):
        super().__init__(g, LOWERINGS)
        self.b, self.dtype, self.cache_len = b, dtype, cache_len
        self.scatter_idx: str | None = None
        self.biases: dict[object, str] = {}
        self.row_index: dict[tuple[str, str], str] = {}
        self.groups: list[_Group] | None = None
        self.quantized: dict[str, str] = {}  # full param name -> block format (MatMulNBits layout)
        self.shapes = {full: p.shape for full, p, _ in g.all_params()}


class _Group:
    """Entries of one attention call in a ragged step: their rows, positions and reach."""

    def __init__(self, slots: str, pos: str, kv_len: str, gather, scatter):
        self.slots, self.pos, self.kv_len = slots, pos, kv_len
        self.gather, self.scatter = gather, scatter  # packed [1, N, ...] -> [E, T, ...] and back


OnnxLowering = Callable[[_Lowering, Node, list[str]], list[str]]


def _positions(L: _Lowering, n: Node, x: list[str]) -> list[str]:
    b = L.b
    t = b.op("Gather", [b.op("Shape", [x[1]]), b.const(1)], axis=0)  # T
    steps = b.op("Range", [b.const(0), t, b.const(1)])  # [T]
    return [b.op("Add", [b.op("Unsqueeze", [x[0], b.const([1])]), steps], "pos")]  # [B, T]


def _rope_table(L: _Lowering, n: Node, x: list[str]) -> list[str]:
    return list(decompose.rope_table(L.b, x[0], inv_freq(n.attrs["rope"], n.attrs["rotary_dim"])))


def _linear(L: _Lowering, n: Node, x: list[str]) -> list[str]:
    fmt = L.quantized.get(x[1])
    if fmt:  # blocks [N, nb, bytes] and scales [N, nb], as MatMulNBits takes them
        rows, k = L.shapes[x[1]]
        y = L.b.op("MatMulNBits", [x[0], f"{x[1]}.values", f"{x[1]}.scales"], domain=MS_DOMAIN, K=k, N=rows,
                   bits=NBITS[fmt], block_size=BLOCK, accuracy_level=NBITS_ACCURACY[fmt])
    else:  # weights are stored transposed ([in, out]) so MatMul reads them as they lie
        y = L.b.op("MatMul", [x[0], x[1]])
    return [L.b.op("Add", [y, x[2]]) if len(x) == 3 else y]


def _experts(L: _Lowering, n: Node, x: list[str]) -> list[str]:
    """Dense: every expert over every token, weight 0 where not chosen (one graph for every step, at
    E / top_k times the chosen experts' multiplications). Gate and up are one linear each over all
    experts' rows; the down projections one MatMul batched over experts, summed."""
    b = L.b
    h, weights, gate, up, down = x
    count = L.g.values[n.inputs[1]].shape[-1]
    rows, width = L.shapes[down]  # [E * H, F]
    hidden = rows // count
    activated = decompose.activation(b, _linear(L, n, [h, gate])[0], n.attrs["act"])
    gated = b.op("Mul", [activated, _linear(L, n, [h, up])[0]])
    gated = b.op("Mul", [b.op("Reshape", [gated, b.const([0, 0, count, width])]),
                         b.op("Unsqueeze", [weights, b.const([-1])])])  # [B, T, E, F]
    per_expert = b.op("Reshape", [b.op("Transpose", [gated], perm=[2, 0, 1, 3]), b.const([count, -1, width])])
    fmt = L.quantized.get(down)
    if fmt:  # [E * H, F] dequantized, then [E, F, H]
        matrix = b.to_act(decompose.dequantize(b, f"{down}.values", f"{down}.scales", NBITS[fmt]))
        stacked = b.op("Transpose", [b.op("Reshape", [matrix, b.const([count, hidden, width])])], perm=[0, 2, 1])
    else:  # stored transposed, [F, E * H] -> [E, F, H]
        stacked = b.op("Transpose", [b.op("Reshape", [down, b.const([width, count, hidden])])], perm=[1, 0, 2])
    summed = b.op("ReduceSum", [b.op("MatMul", [per_expert, stacked]), b.const([0])], keepdims=0)  # [B * T, H]
    return [b.op("Reshape", [summed, b.op("Shape", [h])])]


def _embedding(L: _Lowering, n: Node, x: list[str]) -> list[str]:
    fmt = L.quantized.get(x[1])
    if not fmt:
        return [L.b.op("Gather", [x[1], x[0]], axis=0)]
    # The rows' blocks, dequantized in the graph: [B, T, nb, bytes] -> [B, T, nb * 32]
    values = L.b.op("Gather", [f"{x[1]}.values", x[0]], axis=0)  # [B, T, nb, 32 * bits / 8]
    scales = L.b.op("Gather", [f"{x[1]}.scales", x[0]], axis=0)  # [B, T, nb]
    return [L.b.to_act(decompose.dequantize(L.b, values, scales, NBITS[fmt]))]


def _reshape(L: _Lowering, n: Node, x: list[str]) -> list[str]:
    src = L.g.values[n.inputs[0]].shape
    # Symbols copied from the same position of the input become 0 ("keep"), any other one -1.
    dims = [0 if isinstance(d, str) and i < len(src) and src[i] == d else -1 if isinstance(d, str) else d
            for i, d in enumerate(n.attrs["shape"])]
    return [L.b.op("Reshape", [x[0], L.b.const(dims)])]


def _scatter_indices(L: _Lowering, pos: str, slots: str, kv_heads: int, per_token: bool) -> str:
    """ScatterND indices [B, T, KV, 3] = (slot, head, position) for cache [rows, KV, S, D];
    slots is [B] (one per entry) or, per_token (ragged), [1, N]."""
    if L.scatter_idx is None:
        b = L.b
        shape = b.op("Concat", [b.op("Shape", [pos]), b.const([kv_heads, 1])], axis=0)  # [B, T, KV, 1]
        slot = b.op("Expand", [b.op("Unsqueeze", [slots, b.const([2, 3] if per_token else [1, 2, 3])]), shape])
        heads = b.op("Expand", [b.const(np.arange(kv_heads).reshape(1, 1, kv_heads, 1)), shape])
        position = b.op("Expand", [b.op("Unsqueeze", [pos, b.const([2, 3])]), shape])
        L.scatter_idx = b.op("Concat", [slot, heads, position], "cache_index", axis=-1)
    return L.scatter_idx


def _bias(L: _Lowering, pos: str, kv_len: str, window) -> str:
    """The additive attention mask [B, 1, 1, T, kv_len] (decompose.attention_bias), one per
    group of queries and window."""
    if (pos, window) not in L.biases:
        b = L.b
        key_pos = b.op("Range", [b.const(0), b.op("Squeeze", [kv_len, b.const([0])]), b.const(1)])  # [L]
        L.biases[(pos, window)] = decompose.attention_bias(b, pos, key_pos, window)
    return L.biases[(pos, window)]


def _row_index(L: _Lowering, slots: str, kv_len: str, kv_heads: int) -> str:
    """Indices [B, KV, L] into the cache viewed as [rows*KV*S, D]: (slot, head, position < kv_len)."""
    if (slots, kv_len) not in L.row_index:
        b, S = L.b, L.cache_len
        row = b.op("Mul", [b.op("Unsqueeze", [slots, b.const([1, 2])]), b.const(kv_heads * S)])  # [B, 1, 1]
        head = b.const(np.arange(kv_heads).reshape(1, kv_heads, 1) * S)  # [1, KV, 1]
        position = b.op("Range", [b.const(0), b.op("Squeeze", [kv_len, b.const([0])]), b.const(1)])  # [L]
        L.row_index[(slots, kv_len)] = b.op("Add", [b.op("Add", [row, head]), position])
    return L.row_index[(slots, kv_len)]


def _ragged_groups(L: _Lowering, pos: str, index: list[str]) -> list[_Group]:
    """The two attention groups of a ragged step: the one-token rows (the first Bd tokens) and
    the chunks, gathered into [Bp, Tp] by `p_index` (padding repeats a chunk's last token)."""
    if L.groups is None:
        b = L.b
        d_slots, d_kv_len, p_slots, p_index, p_pack, p_kv_len = index
        n_decode = b.op("Shape", [d_slots])  # [1] = Bd

        def decode_in(x: str) -> str:  # [1, N, ...] -> [Bd, 1, ...]
            head = b.op("Slice", [x, b.const([0]), n_decode, b.const([1])])
            return b.op("Unsqueeze", [b.op("Squeeze", [head, b.const([0])]), b.const([1])])

        def decode_out(x: str) -> str:  # [Bd, 1, ...] -> [1, Bd, ...]
            return b.op("Unsqueeze", [b.op("Squeeze", [x, b.const([1])]), b.const([0])])

        def chunks_in(x: str) -> str:  # [1, N, ...] -> [Bp, Tp, ...]
            return b.op("Squeeze", [b.op("Gather", [x, p_index], axis=1), b.const([0])])

        def chunks_out(x: str) -> str:  # [Bp, Tp, ...] -> [1, Np, ...]: padding dropped
            dims = b.op("Shape", [x])
            entries = b.op("ReduceProd", [b.op("Slice", [dims, b.const([0]), b.const([2])])], keepdims=1)  # [Bp*Tp]
            rest = b.op("Slice", [dims, b.const([2]), b.const([INT64_MAX])])
            shape = b.op("Concat", [b.const([1]), entries, rest], axis=0)
            flat = b.op("Reshape", [x, shape], allowzero=1)  # [1, Bp*Tp, ...]
            return b.op("Gather", [flat, p_pack], axis=1)

        L.groups = [_Group(d_slots, decode_in(pos), d_kv_len, decode_in, decode_out),
                    _Group(p_slots, chunks_in(pos), p_kv_len, chunks_in, chunks_out)]
    return L.groups


def _attention(L: _Lowering, n: Node, x: list[str]) -> list[str]:
    b, i = L.b, L.layer
    kv_heads = L.g.values[n.inputs[1]].shape[2]
    q, k, v, pos, slots = x[:5]
    ragged = L.attr(n, "ragged")
    idx = _scatter_indices(L, pos, slots, kv_heads, per_token=ragged)
    caches = [b.op("ScatterND", [f"{kind}_cache.{i}", idx, new], f"{kind}_cache_out.{i}")
              for kind, new in (("k", k), ("v", v))]
    if not ragged:
        return [_attend(L, n, q, caches, pos, slots, "kv_len")]
    groups = _ragged_groups(L, pos, x[5:])
    outs = [g.scatter(_attend(L, n, g.gather(q), caches, g.pos, g.slots, g.kv_len, exact=True)) for g in groups]
    return [b.op("Concat", outs, axis=1)]  # [1, N, H, D]: the decode rows' tokens come first


def _attend(L: _Lowering, n: Node, q: str, caches: list[str], pos: str, slots: str, kv_len: str,
            exact: bool = False) -> str:
    """q [B, T, H, D] over the first kv_len positions of cache rows `slots` -> [B, T, H, D].
    `exact`: B may be 0 (a ragged group with no entries), so a 0 in a shape is a size, not "keep"."""
    b, g = L.b, L.g
    q_shape, k_shape = g.values[n.inputs[0]].shape, g.values[n.inputs[1]].shape
    heads, kv_heads, hd = q_shape[2], k_shape[2], q_shape[3]
    # This step's rows, first kv_len positions, in one copy each: [B, KV, L, D]
    keys, values = (b.op("Gather", [b.op("Reshape", [cache, b.const([-1, hd])]),  # [rows*KV*S, D], a view
                                    _row_index(L, slots, kv_len, kv_heads)], axis=0) for cache in caches)
    group = heads // kv_heads
    # [B, T, H, D] -> [B, KV, G, T, D]; the shape is spelled out, as B may be 0 in a ragged step
    bt = b.op("Slice", [b.op("Shape", [q]), b.const([0]), b.const([2])])  # [B, T]
    b_only, t_only = (b.op("Slice", [bt, b.const([k]), b.const([k + 1])]) for k in (0, 1))
    zeros = {"allowzero": 1} if exact else {}
    q5 = b.op("Reshape", [b.op("Transpose", [q], perm=[0, 2, 1, 3]),
                          b.op("Concat", [b_only, b.const([kv_heads, group]), t_only, b.const([hd])], axis=0)], **zeros)
    bias = _bias(L, pos, kv_len, L.attr(n, "window"))
    out = decompose.attend(b, q5, keys, values, bias, L.attr(n, "scale"),
                           L.attr(n, "softcap"))  # [B, KV, G, T, D]
    out = b.op("Reshape", [out, b.op("Concat", [b_only, b.const([heads]), t_only, b.const([hd])], axis=0)],
               **zeros)  # [B, H, T, D]
    return b.op("Transpose", [out], perm=[0, 2, 1, 3])


def _last_token(L: _Lowering, n: Node, x: list[str]) -> list[str]:
    b = L.b
    if L.attr(n, "ragged"):  # [1, N, H] -> [E, 1, H]: the tokens logits_index names
        return [b.op("Transpose", [b.op("Gather", [x[0], x[1]], axis=1)], perm=[1, 0, 2])]
    return [b.op("Slice", [x[0], "logits_from", b.const([INT64_MAX]), b.const([1])])]


LOWERINGS: dict[str, OnnxLowering] = {
    "positions": _positions,
    "rope_table": _rope_table,
    "embedding": _embedding,
    "rms_norm": lambda L, n, x: [L.b.op("RMSNormalization", x, axis=-1, epsilon=float(n.attrs["eps"]), stash_type=1)],
    "linear": _linear,
    "split": lambda L, n, x: L.b.op("Split", [x[0], L.b.const(n.attrs["sizes"])], len(n.outputs), axis=-1)
    if len(n.outputs) > 1 else [x[0]],
    "reshape": _reshape,
    "rope": lambda L, n, x: [decompose.rope(L.b, *x, L.g.values[n.inputs[1]].shape[-1],
                                            L.g.values[n.inputs[0]].shape[-1]) if L.attr(n, "apply") else x[0]],
    "attention": _attention,
    "silu": lambda L, n, x: [decompose.silu(L.b, x[0])],
    "gelu": lambda L, n, x: [L.b.op("Gelu", x, approximate=n.attrs["approximate"])],
    "mul": lambda L, n, x: [L.b.op("Mul", x)],
    "scale": lambda L, n, x: [decompose.scale(L.b, x[0], n.attrs["factor"])],
    "softcap": lambda L, n, x: [decompose.softcap(L.b, x[0], n.attrs["cap"])],
    "pick": lambda L, n, x: [x[L.attr(n, "index")]],
    "add": lambda L, n, x: [L.b.op("Add", x)],
    "route": lambda L, n, x: [decompose.route(L.b, x[0], L.g.values[n.inputs[0]].shape[-1], n.attrs["top_k"],
                                              n.attrs["normalize"])],
    "experts": _experts,
    "last_token": _last_token,
    "argmax": lambda L, n, x: [L.b.op(
        "ArgMax", [L.b.op("Squeeze", [L.b.op("Slice", [x[0], L.b.const([-1]), L.b.const([INT64_MAX]), L.b.const([1])]),
                                      L.b.const([1])])], axis=-1, keepdims=0)],
}


def quantized_params(graph: Graph, dtype: str) -> dict[str, str]:
    """{full name: block format} of the weights stored in MatMulNBits' layout under `dtype`."""
    return {name: fmt for name, fmt in param_formats(graph, dtype).items() if FORMATS[fmt].quantized}


def transposed(graph: Graph) -> set[str]:
    """Full names of the 2-D weights that feed MatMul, stored transposed ([in, out])."""
    names = prepared.linear_weights(graph)
    return set(names["global"]) | {graph.block_param_name(n, i) for i in range(graph.block.count) for n in names["block"]}


# The dense entry point's inputs: the graph's own (ids, start, slots), then two of the frame's.
DENSE_INPUTS: dict[str, tuple[list, str]] = {
    "ids": (["B", "T"], "token ids"),
    "start": (["B"], "first position of this step in each row"),
    "slots": (["B"], "cache row of each batch entry"),
    "kv_len": ([1], "positions to attend over: max(start + T)"),
    "logits_from": ([1], "first position whose logits are returned: T-1 for the last only, 0 for all"),
}


def step_inputs(graph: Graph) -> dict[str, tuple[list, str]]:
    """The entry point's int64 inputs in order: name -> (shape, meaning)."""
    if graph.ragged:
        return {name: (list(shape), doc) for name, (shape, doc) in RAGGED_INPUTS.items()}
    return DENSE_INPUTS


def interface(graph: Graph, dtype: str, cache_len: int) -> dict:
    """The entry point's names, shapes and cache layout, for people who run the graph elsewhere."""
    c = graph.cache
    ragged = graph.ragged
    entries, rows = ("E", "the tokens logits_index names") if ragged else ("B", "B")
    return {
        "format": "linnet-onnx-ragged/1" if ragged else "linnet-onnx/1",
        "linnet": __version__,
        "opset": OPSET,
        "dtype": compute_dtype(dtype),  # activations, logits and the cache
        "weights": dtype,  # q8_0 / q4_0: MatMulNBits' <name>.values and <name>.scales
        "cache_len": cache_len,
        "entry": ("one step over N tokens from any mix of cache rows (decode tokens and prompt chunks)" if ragged else
                  "one graph for prefill (T tokens of one row) and batched decode (one token for each of B rows)"),
        "inputs": {name: [*shape, "int64", doc] for name, (shape, doc) in step_inputs(graph).items()},
        "outputs": {"next_token": [entries, "int64", f"greedy choice for each of {rows}"],
                    "logits": [entries, "T'", graph.meta["spec"]["vocab_size"], compute_dtype(dtype)]},
        "cache": {
            "layout": ["rows", "kv_heads", "cache_len", "head_dim"],
            "per_layer": [f"k_cache.{i}" for i in range(c.layers)] + [f"v_cache.{i}" for i in range(c.layers)],
            "outputs": "k_cache_out.<i>, v_cache_out.<i>: bind each to its input's buffer to update in place",
            "layers": c.layers, "kv_heads": c.kv_heads, "head_dim": c.head_dim,
        },
    }


def build_onnx(graph: Graph, dtype: str, cache_len: int):
    """The ONNX model of `graph` (its step form), weights not yet attached."""
    require_onnx()
    from onnx import TensorProto, helper

    if dtype not in FORMATS:
        raise IRError(f"the ONNX emitter has no dtype '{dtype}'")
    verify(graph)
    act = compute_dtype(dtype)
    b = OnnxGraphBuilder(act)
    L = _Lowering(graph, b, act, cache_len)
    L.quantized = quantized_params(graph, dtype)
    elem = FORMATS[act].onnx
    c = graph.cache
    declared = step_inputs(graph)
    inputs = [helper.make_tensor_value_info(name, ONNX_INT64, shape) for name, (shape, _) in declared.items()]
    for kind in ("k", "v"):
        inputs += [helper.make_tensor_value_info(f"{kind}_cache.{i}", elem, ["rows", c.kv_heads, cache_len, c.head_dim])
                   for i in range(c.layers)]
    b._names.update(declared)
    for name in [v.name for v in graph.inputs] + [full for full, _, _ in graph.all_params()]:
        L.env[name] = name  # graph inputs and weight initializers keep their names

    next_token, logits = L.run()
    b.nodes.append(helper.make_node("Identity", [next_token], ["next_token"], name="out_next_token"))
    b.nodes.append(helper.make_node("Identity", [logits], ["logits"], name="out_logits"))
    entries = "E" if graph.ragged else "B"
    outputs = [helper.make_tensor_value_info("next_token", TensorProto.INT64, [entries]),
               helper.make_tensor_value_info("logits", elem, [entries, "Tout", graph.meta["spec"]["vocab_size"]])]
    for kind in ("k", "v"):
        outputs += [helper.make_tensor_value_info(f"{kind}_cache_out.{i}", elem,
                                                  ["rows", c.kv_heads, cache_len, c.head_dim]) for i in range(c.layers)]
    g = helper.make_graph(b.nodes, "linnet", inputs, outputs, initializer=b.initializers)
    opsets = [helper.make_opsetid("", OPSET)] + ([helper.make_opsetid(MS_DOMAIN, 1)] if L.quantized else [])
    model = helper.make_model(g, opset_imports=opsets, producer_name="linnet", producer_version=__version__)
    model.ir_version = IR_VERSION
    return model


def write_onnx(model, graph: Graph, ckpt: Checkpoint, dtype: str, cache_len: int, out: Path,
               model_name: str = "model.onnx", place: Placer = write_here) -> dict:
    """The weights into `{model_name}.data` (through `place`: linked from the cache's store when it
    holds them), then the model that points into it and `interface.json`; returns the interface."""
    onnx = require_onnx()
    data = f"{model_name}.data"
    entries = external_layout(graph, dtype)
    place(out / data, "onnx", fingerprint([(name, shape, offset, fmt) for name, shape, offset, _, fmt in entries]),
          lambda path: _write_external_weights(graph, ckpt, dtype, path, entries))
    model.graph.initializer.extend(_external_protos(entries, data))
    onnx.save_model(model, str(out / model_name))
    info = interface(graph, dtype, cache_len)
    (out / "interface.json").write_text(json.dumps(info, indent=2))
    return info


def emit_onnx(graph: Graph, ckpt: Checkpoint, dtype: str, cache_len: int, out: Path,
              model_name: str = "model.onnx") -> dict:
    """Write `model.onnx` and its external weights into `out` in the graph's step form; returns
    the interface JSON."""
    prepared.check_against(graph, ckpt)
    return write_onnx(build_onnx(graph, dtype, cache_len), graph, ckpt, dtype, cache_len, out, model_name)


DATA_ALIGN = 4096  # every tensor at a page boundary: ONNX Runtime maps such external data instead of reading it


def external_layout(graph: Graph, dtype: str) -> list[tuple[str, list[int], int, int, str]]:
    """(name, shape as stored, offset, length, format) of every tensor in the data file: linear
    weights transposed ([in, out], as MatMul takes them), a block-quantized weight as its values and
    scales (`<name>.values`, `<name>.scales`: MatMulNBits' layout), each at an aligned offset. Fixed
    by the graph and dtype alone, so an existing data file can be pointed into without reading it."""
    transpose, quantized = transposed(graph), quantized_params(graph, dtype)
    act = compute_dtype(dtype)
    out, offset = [], 0
    for full, p, _ in graph.all_params():
        if full in quantized:
            values, scales = nbits_shapes(*p.shape, quantized[full])
            tensors = [(f"{full}.values", list(values), "uint8"), (f"{full}.scales", list(scales), "float32")]
        else:
            tensors = [(full, list(p.shape[::-1]) if full in transpose else list(p.shape), act)]
        for name, shape, fmt in tensors:
            offset += -offset % DATA_ALIGN
            length = int(np.prod(shape, dtype=np.int64)) * (1 if fmt == "uint8" else FORMATS[fmt].block_bytes)
            out.append((name, shape, offset, length, fmt))
            offset += length
    return out


def _stored_tensors(graph: Graph, ckpt: Checkpoint, dtype: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor as stored) in external_layout's order, one weight prepared at a time."""
    transpose, quantized = transposed(graph), quantized_params(graph, dtype)
    torch_dt = torch_dtype(dtype)
    for full, p, layer in graph.all_params():
        if full in quantized:  # from float32, as llama.cpp's quantizer takes them: GGUF's very blocks
            values, scales = nbits_layout(quantize(prepared.materialize(p, layer, ckpt, torch.float32),
                                                   quantized[full]), quantized[full])
            yield f"{full}.values", values
            yield f"{full}.scales", scales
        else:
            t = prepared.materialize(p, layer, ckpt, torch_dt)
            yield full, (t.t() if full in transpose else t).contiguous()
        prepared.release_sources(p, layer, ckpt)


def _external_protos(entries: list[tuple[str, list[int], int, int, str]], location: str) -> list:
    from onnx import TensorProto

    protos = []
    for name, shape, offset, length, fmt in entries:
        elem = TensorProto.UINT8 if fmt == "uint8" else FORMATS[fmt].onnx
        proto = TensorProto(name=name, data_type=elem, dims=shape, data_location=TensorProto.EXTERNAL)
        for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
            entry = proto.external_data.add()
            entry.key, entry.value = key, value
        protos.append(proto)
    return protos


def _write_external_weights(graph: Graph, ckpt: Checkpoint, dtype: str, path: Path,
                            entries: list[tuple[str, list[int], int, int, str]]) -> None:
    """Stream every weight into the data file at its place in `entries`, one tensor at a time."""
    with open(path, "wb") as f:
        for (name, t), (entry, shape, offset, length, _) in zip(_stored_tensors(graph, ckpt, dtype), entries):
            assert name == entry and list(t.shape) == shape and t.numel() * t.element_size() == length, name
            f.seek(offset)
            f.write((t.view(torch.uint8) if t.numel() else t).numpy().tobytes())
            del t
        f.flush()
        os.fsync(f.fileno())
