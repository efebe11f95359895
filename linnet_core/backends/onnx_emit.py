"""Emitter: Linnet IR -> an ONNX model, written directly with `onnx` (no tracing).

One graph serves prefill and decode (dynamic B and T) over a static KV cache held as one input
and one output per layer and per K/V, `[rows, kv_heads, cache_len, head_dim]`: bind each output
to its input's buffer and ScatterND updates the cache in place. The next token is an output
(ArgMax in the graph), so a greedy step moves B integers to the host, never the logits.

The ragged form (ONNX Runtime's artifact) takes one step of N tokens from any mix of rows: the
linear layers run over the N tokens packed together, and attention runs twice, over the
one-token rows and over the multi-token chunks padded to one length. So decode rows ride along
with a prompt chunk in one pass over the weights, the way serving engines batch.

Weights are streamed to one external data file as they are prepared, so a model of any size is
emitted in bounded memory and stays under protobuf's 2 GB limit. Each IR op lowers through one
function in LOWERINGS; an op without one fails at emit time, naming it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from .. import __version__
from .. import params as prepared
from ..errors import BackendUnavailable, IRError
from ..ir.graph import Graph, Node
from ..ir.rope import inv_freq
from ..ir.verify import verify
from ..weights import Checkpoint
from .lowering import Lowering

OPSET = 23
INT64_MAX = np.iinfo(np.int64).max
ONNX_DTYPES = {"float32": 1, "float16": 10, "bfloat16": 16}  # onnx.TensorProto enum values


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
            self._consts[key] = self.op("Cast", [c], to=ONNX_DTYPES[self.dtype])
        return self._consts[key]


class _Lowering(Lowering):
    """State shared by the ONNX op lowerings of one graph (env holds ONNX value names)."""

    emitter = "ONNX"

    def __init__(self, g: Graph, b: OnnxGraphBuilder, dtype: str, cache_len: int, ragged: bool = False):
        super().__init__(g, LOWERINGS)
        self.b, self.dtype, self.cache_len, self.ragged = b, dtype, cache_len, ragged
        self.scatter_idx: str | None = None
        self.masks: dict[object, str] = {}
        self.row_index: dict[tuple[str, str], str] = {}
        self.groups: list[_Group] | None = None


class _Group:
    """Entries of one attention call in a ragged step: their rows, positions and reach."""

    def __init__(self, slots: str, pos: str, kv_len: str, gather, scatter):
        self.slots, self.pos, self.kv_len = slots, pos, kv_len
        self.gather, self.scatter = gather, scatter  # packed [1, N, ...] -> [E, T, ...] and back


OnnxLowering = Callable[[_Lowering, Node, list[str]], list[str]]


def _positions(L: _Lowering, n: Node, x: list[str]) -> list[str]:
    if L.ragged:
        return ["pos"]  # [1, N], given per token
    b = L.b
    t = b.op("Gather", [b.op("Shape", [x[1]]), b.const(1)], axis=0)  # T
    steps = b.op("Range", [b.const(0), t, b.const(1)])  # [T]
    return [b.op("Add", [b.op("Unsqueeze", [x[0], b.const([1])]), steps], "pos")]  # [B, T]


def _rope_table(L: _Lowering, n: Node, x: list[str]) -> list[str]:
    b = L.b
    freqs = np.asarray(inv_freq(n.attrs["rope"], n.attrs["rotary_dim"]), dtype=np.float32)
    angles = b.op("Mul", [b.op("Unsqueeze", [b.op("Cast", [x[0]], to=1), b.const([2])]),
                          b.const(freqs, np.float32, "rope_inv_freq")])  # [B, T, rot/2], float32
    emb = b.op("Concat", [angles, angles], axis=-1)  # [B, T, rot]
    to = ONNX_DTYPES[L.dtype]
    # [B, T, 1, rot]: broadcast over heads
    return [b.op("Unsqueeze", [b.op("Cast", [b.op(f, [emb])], to=to), b.const([2])], name)
            for f, name in (("Cos", "rope_cos"), ("Sin", "rope_sin"))]


def _linear(L: _Lowering, n: Node, x: list[str]) -> list[str]:
    # Weights are stored transposed ([in, out]) so MatMul reads them as they lie.
    y = L.b.op("MatMul", [x[0], x[1]])
    return [L.b.op("Add", [y, x[2]]) if len(x) == 3 else y]


def _reshape(L: _Lowering, n: Node, x: list[str]) -> list[str]:
    src = L.g.values[n.inputs[0]].shape
    # Symbols copied from the same position of the input become 0 ("keep"), any other one -1.
    dims = [0 if isinstance(d, str) and i < len(src) and src[i] == d else -1 if isinstance(d, str) else d
            for i, d in enumerate(n.attrs["shape"])]
    return [L.b.op("Reshape", [x[0], L.b.const(dims)])]


def _rope(L: _Lowering, n: Node, x: list[str]) -> list[str]:
    b = L.b
    rot = L.g.values[n.inputs[1]].shape[-1]
    head = L.g.values[n.inputs[0]].shape[-1]
    half = rot // 2

    def part(lo: int, hi: int) -> str:
        return b.op("Slice", [x[0], b.const([lo]), b.const([hi]), b.const([-1])])

    x_rot = part(0, rot) if rot < head else x[0]
    x1 = b.op("Slice", [x_rot, b.const([0]), b.const([half]), b.const([-1])])
    x2 = b.op("Slice", [x_rot, b.const([half]), b.const([rot]), b.const([-1])])
    rotated = b.op("Concat", [b.op("Neg", [x2]), x1], axis=-1)
    out = b.op("Add", [b.op("Mul", [x_rot, x[1]]), b.op("Mul", [rotated, x[2]])])
    return [b.op("Concat", [out, part(rot, head)], axis=-1) if rot < head else out]


def _scatter_indices(L: _Lowering, pos: str, slots: str, kv_heads: int) -> str:
    """ScatterND indices [B, T, KV, 3] = (slot, head, position) for cache [rows, KV, S, D];
    slots is [B] (one per entry) or, ragged, [1, N] (one per token)."""
    if L.scatter_idx is None:
        b = L.b
        shape = b.op("Concat", [b.op("Shape", [pos]), b.const([kv_heads, 1])], axis=0)  # [B, T, KV, 1]
        slot = b.op("Expand", [b.op("Unsqueeze", [slots, b.const([2, 3] if L.ragged else [1, 2, 3])]), shape])
        heads = b.op("Expand", [b.const(np.arange(kv_heads).reshape(1, 1, kv_heads, 1)), shape])
        position = b.op("Expand", [b.op("Unsqueeze", [pos, b.const([2, 3])]), shape])
        L.scatter_idx = b.op("Concat", [slot, heads, position], "cache_index", axis=-1)
    return L.scatter_idx


def _mask(L: _Lowering, pos: str, kv_len: str, window) -> str:
    """Additive mask [B, 1, 1, T, kv_len]: 0 where a query may see a key, -inf elsewhere."""
    if (pos, window) not in L.masks:
        b = L.b
        key_pos = b.op("Range", [b.const(0), b.op("Squeeze", [kv_len, b.const([0])]), b.const(1)])  # [L]
        q_pos = b.op("Unsqueeze", [pos, b.const([2])])  # [B, T, 1]
        allowed = b.op("LessOrEqual", [key_pos, q_pos])  # causal; also hides stale cache entries
        if window is not None:
            allowed = b.op("And", [allowed, b.op("Greater", [key_pos, b.op("Sub", [q_pos, b.const(window)])])])
        bias = b.op("Where", [allowed, b.act_const(0.0), b.act_const(-np.inf)])  # [B, T, L]
        L.masks[(pos, window)] = b.op("Unsqueeze", [bias, b.const([1, 2])], f"mask_w{window}")
    return L.masks[(pos, window)]


def _row_index(L: _Lowering, slots: str, kv_len: str, kv_heads: int) -> str:
    """Indices [B, KV, L] into the cache viewed as [rows*KV*S, D]: (slot, head, position < kv_len)."""
    if (slots, kv_len) not in L.row_index:
        b, S = L.b, L.cache_len
        row = b.op("Mul", [b.op("Unsqueeze", [slots, b.const([1, 2])]), b.const(kv_heads * S)])  # [B, 1, 1]
        head = b.const(np.arange(kv_heads).reshape(1, kv_heads, 1) * S)  # [1, KV, 1]
        position = b.op("Range", [b.const(0), b.op("Squeeze", [kv_len, b.const([0])]), b.const(1)])  # [L]
        L.row_index[(slots, kv_len)] = b.op("Add", [b.op("Add", [row, head]), position])
    return L.row_index[(slots, kv_len)]


def _ragged_groups(L: _Lowering) -> list[_Group]:
    """The two attention groups of a ragged step: the one-token rows (the first Bd tokens) and
    the chunks, gathered into [Bp, Tp] by `p_index` (padding repeats a chunk's last token)."""
    if L.groups is None:
        b = L.b
        n_decode = b.op("Shape", ["d_slots"])  # [1] = Bd

        def decode_in(x: str) -> str:  # [1, N, ...] -> [Bd, 1, ...]
            head = b.op("Slice", [x, b.const([0]), n_decode, b.const([1])])
            return b.op("Unsqueeze", [b.op("Squeeze", [head, b.const([0])]), b.const([1])])

        def decode_out(x: str) -> str:  # [Bd, 1, ...] -> [1, Bd, ...]
            return b.op("Unsqueeze", [b.op("Squeeze", [x, b.const([1])]), b.const([0])])

        def chunks_in(x: str) -> str:  # [1, N, ...] -> [Bp, Tp, ...]
            return b.op("Squeeze", [b.op("Gather", [x, "p_index"], axis=1), b.const([0])])

        def chunks_out(x: str) -> str:  # [Bp, Tp, ...] -> [1, Np, ...]: padding dropped
            dims = b.op("Shape", [x])
            entries = b.op("ReduceProd", [b.op("Slice", [dims, b.const([0]), b.const([2])])], keepdims=1)  # [Bp*Tp]
            rest = b.op("Slice", [dims, b.const([2]), b.const([INT64_MAX])])
            shape = b.op("Concat", [b.const([1]), entries, rest], axis=0)
            flat = b.op("Reshape", [x, shape], allowzero=1)  # [1, Bp*Tp, ...]
            return b.op("Gather", [flat, "p_pack"], axis=1)

        L.groups = [_Group("d_slots", decode_in("pos"), "d_kv_len", decode_in, decode_out),
                    _Group("p_slots", chunks_in("pos"), "p_kv_len", chunks_in, chunks_out)]
    return L.groups


def _attention(L: _Lowering, n: Node, x: list[str]) -> list[str]:
    b, i = L.b, L.layer
    kv_heads = L.g.values[n.inputs[1]].shape[2]
    q, k, v, pos, slots = x
    idx = _scatter_indices(L, pos, slots, kv_heads)
    caches = [b.op("ScatterND", [f"{kind}_cache.{i}", idx, new], f"{kind}_cache_out.{i}")
              for kind, new in (("k", k), ("v", v))]
    if not L.ragged:
        return [_attend(L, n, q, caches, pos, slots, "kv_len")]
    outs = [g.scatter(_attend(L, n, g.gather(q), caches, g.pos, g.slots, g.kv_len)) for g in _ragged_groups(L)]
    return [b.op("Concat", outs, axis=1)]  # [1, N, H, D]: the decode rows' tokens come first


def _attend(L: _Lowering, n: Node, q: str, caches: list[str], pos: str, slots: str, kv_len: str) -> str:
    """q [B, T, H, D] over the first kv_len positions of cache rows `slots` -> [B, T, H, D]."""
    b, g = L.b, L.g
    q_shape, k_shape = g.values[n.inputs[0]].shape, g.values[n.inputs[1]].shape
    heads, kv_heads, hd = q_shape[2], k_shape[2], q_shape[3]
    attended = []
    for cache in caches:
        # This step's rows, first kv_len positions, in one copy: [B, KV, L, D]
        flat = b.op("Reshape", [cache, b.const([-1, hd])])  # [rows*KV*S, D], a view
        rows = b.op("Gather", [flat, _row_index(L, slots, kv_len, kv_heads)], axis=0)
        attended.append(b.op("Unsqueeze", [rows, b.const([2])]))  # [B, KV, 1, L, D]
    keys, values = attended
    group = heads // kv_heads
    # [B, T, H, D] -> [B, KV, G, T, D]; the shape is spelled out, as B may be 0 in a ragged step
    bt = b.op("Slice", [b.op("Shape", [q]), b.const([0]), b.const([2])])  # [B, T]
    b_only, t_only = (b.op("Slice", [bt, b.const([k]), b.const([k + 1])]) for k in (0, 1))
    exact = {"allowzero": 1} if L.ragged else {}  # a 0 in these shapes is a size, not "keep"
    q5 = b.op("Reshape", [b.op("Transpose", [q], perm=[0, 2, 1, 3]),
                          b.op("Concat", [b_only, b.const([kv_heads, group]), t_only, b.const([hd])], axis=0)], **exact)
    scores = b.op("MatMul", [q5, b.op("Transpose", [keys], perm=[0, 1, 2, 4, 3])])  # [B, KV, G, T, L]
    mask = _mask(L, pos, kv_len, L.attr(n, "window"))
    scores = b.op("Add", [b.op("Mul", [scores, b.act_const(L.attr(n, "scale"))]), mask])
    if L.dtype != "float32":  # softmax in float32, as the reference does
        probs = b.op("Cast", [b.op("Softmax", [b.op("Cast", [scores], to=1)], axis=-1)], to=ONNX_DTYPES[L.dtype])
    else:
        probs = b.op("Softmax", [scores], axis=-1)
    out = b.op("MatMul", [probs, values])  # [B, KV, G, T, D]
    out = b.op("Reshape", [out, b.op("Concat", [b_only, b.const([heads]), t_only, b.const([hd])], axis=0)],
               **exact)  # [B, H, T, D]
    return b.op("Transpose", [out], perm=[0, 2, 1, 3])


def _last_token(L: _Lowering, n: Node, x: list[str]) -> list[str]:
    b = L.b
    if L.ragged:  # [1, N, H] -> [E, 1, H]: the tokens logits_index names
        return [b.op("Transpose", [b.op("Gather", [x[0], "logits_index"], axis=1)], perm=[1, 0, 2])]
    return [b.op("Slice", [x[0], "logits_from", b.const([INT64_MAX]), b.const([1])])]


def _silu(L: _Lowering, n: Node, x: list[str]) -> list[str]:
    return [L.b.op("Mul", [x[0], L.b.op("Sigmoid", [x[0]])])]


LOWERINGS: dict[str, OnnxLowering] = {
    "positions": _positions,
    "rope_table": _rope_table,
    "embedding": lambda L, n, x: [L.b.op("Gather", [x[1], x[0]], axis=0)],
    "rms_norm": lambda L, n, x: [L.b.op("RMSNormalization", x, axis=-1, epsilon=float(n.attrs["eps"]), stash_type=1)],
    "linear": _linear,
    "split": lambda L, n, x: L.b.op("Split", [x[0], L.b.const(n.attrs["sizes"])], len(n.outputs), axis=-1)
    if len(n.outputs) > 1 else [x[0]],
    "reshape": _reshape,
    "rope": _rope,
    "attention": _attention,
    "silu": _silu,
    "gelu": lambda L, n, x: [L.b.op("Gelu", x, approximate=n.attrs["approximate"])],
    "mul": lambda L, n, x: [L.b.op("Mul", x)],
    "add": lambda L, n, x: [L.b.op("Add", x)],
    "last_token": _last_token,
    "argmax": lambda L, n, x: [L.b.op(
        "ArgMax", [L.b.op("Squeeze", [L.b.op("Slice", [x[0], L.b.const([-1]), L.b.const([INT64_MAX]), L.b.const([1])]),
                                      L.b.const([1])])], axis=-1, keepdims=0)],
}


def transposed(graph: Graph) -> set[str]:
    """Full names of the 2-D weights that feed MatMul, stored transposed ([in, out])."""
    names = prepared.linear_weights(graph)
    return set(names["global"]) | {graph.block_param_name(n, i) for i in range(graph.block.count) for n in names["block"]}


CLASSIC_INPUTS = {
    "ids": (["B", "T"], "token ids"),
    "start": (["B"], "first position of this step in each row"),
    "slots": (["B"], "cache row of each batch entry"),
    "kv_len": ([1], "positions to attend over: max(start + T)"),
    "logits_from": ([1], "first position whose logits are returned: T-1 for the last only, 0 for all"),
}
RAGGED_INPUTS = {
    "ids": ([1, "N"], "the step's tokens: the one-token rows first, then each chunk's tokens"),
    "pos": ([1, "N"], "position of each token in its row"),
    "token_slots": ([1, "N"], "cache row of each token"),
    "d_slots": (["Bd"], "cache row of each one-token row (the first Bd tokens)"),
    "d_kv_len": ([1], "positions the one-token rows attend over: max(pos + 1), at least 1"),
    "p_slots": (["Bp"], "cache row of each chunk"),
    "p_index": (["Bp", "Tp"], "token index of each chunk position; a short chunk repeats its last token"),
    "p_pack": (["Np"], "for each chunk token in order, its place in the flattened [Bp, Tp]"),
    "p_kv_len": ([1], "positions the chunks attend over: max(pos + 1), at least 1"),
    "logits_index": (["E"], "tokens whose logits and next token are returned"),
}


def interface(graph: Graph, dtype: str, cache_len: int, ragged: bool = False) -> dict:
    """The entry point's names, shapes and cache layout, for people who run the graph elsewhere."""
    c = graph.cache
    entries, rows = ("E", "the tokens logits_index names") if ragged else ("B", "B")
    return {
        "format": "linnet-onnx-ragged/1" if ragged else "linnet-onnx/1",
        "linnet": __version__,
        "opset": OPSET,
        "dtype": dtype,
        "cache_len": cache_len,
        "entry": ("one step over N tokens from any mix of cache rows (decode tokens and prompt chunks)" if ragged else
                  "one graph for prefill (T tokens of one row) and batched decode (one token for each of B rows)"),
        "inputs": {name: [*shape, "int64", doc]
                   for name, (shape, doc) in (RAGGED_INPUTS if ragged else CLASSIC_INPUTS).items()},
        "outputs": {"next_token": [entries, "int64", f"greedy choice for each of {rows}"],
                    "logits": [entries, "T'", graph.meta["spec"]["vocab_size"], dtype]},
        "cache": {
            "layout": ["rows", "kv_heads", "cache_len", "head_dim"],
            "per_layer": [f"k_cache.{i}" for i in range(c.layers)] + [f"v_cache.{i}" for i in range(c.layers)],
            "outputs": "k_cache_out.<i>, v_cache_out.<i>: bind each to its input's buffer to update in place",
            "layers": c.layers, "kv_heads": c.kv_heads, "head_dim": c.head_dim,
        },
    }


def emit_onnx(graph: Graph, ckpt: Checkpoint, dtype: str, cache_len: int, out: Path,
              model_name: str = "model.onnx", ragged: bool = False) -> dict:
    """Write `model.onnx` and its external weights into `out`; returns the interface JSON.
    `ragged` takes steps in the ragged form (see the module's docstring)."""
    onnx = require_onnx()
    from onnx import TensorProto, helper

    if dtype not in ONNX_DTYPES:
        raise IRError(f"the ONNX emitter has no dtype '{dtype}'")
    verify(graph)
    b = OnnxGraphBuilder(dtype)
    L = _Lowering(graph, b, dtype, cache_len, ragged)
    elem = ONNX_DTYPES[dtype]
    c = graph.cache
    step_inputs = RAGGED_INPUTS if ragged else CLASSIC_INPUTS
    inputs = [helper.make_tensor_value_info(name, TensorProto.INT64, shape) for name, (shape, _) in step_inputs.items()]
    for kind in ("k", "v"):
        inputs += [helper.make_tensor_value_info(f"{kind}_cache.{i}", elem, ["rows", c.kv_heads, cache_len, c.head_dim])
                   for i in range(c.layers)]
    b._names.update(step_inputs)
    for name in [v.name for v in graph.inputs] + [full for full, _, _ in graph.all_params()]:
        L.env[name] = name  # graph inputs and weight initializers keep their names
    if ragged:  # positions come per token; the cache writes go by each token's row
        L.env["start"], L.env["slots"] = "pos", "token_slots"

    next_token, logits = L.run()
    b.nodes.append(helper.make_node("Identity", [next_token], ["next_token"], name="out_next_token"))
    b.nodes.append(helper.make_node("Identity", [logits], ["logits"], name="out_logits"))
    entries = "E" if ragged else "B"
    outputs = [helper.make_tensor_value_info("next_token", TensorProto.INT64, [entries]),
               helper.make_tensor_value_info("logits", elem, [entries, "Tout", graph.meta["spec"]["vocab_size"]])]
    for kind in ("k", "v"):
        outputs += [helper.make_tensor_value_info(f"{kind}_cache_out.{i}", elem,
                                                  ["rows", c.kv_heads, cache_len, c.head_dim]) for i in range(c.layers)]

    weights = _write_external_weights(graph, ckpt, dtype, out / f"{model_name}.data", f"{model_name}.data")
    g = helper.make_graph(b.nodes, "linnet", inputs, outputs, initializer=b.initializers + weights)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="linnet",
                              producer_version=__version__)
    model.ir_version = 10  # what ONNX Runtime 1.20+ reads; opset 23 needs >= 10
    onnx.save_model(model, str(out / model_name))
    info = interface(graph, dtype, cache_len, ragged)
    (out / "interface.json").write_text(json.dumps(info, indent=2))
    return info


def _write_external_weights(graph: Graph, ckpt: Checkpoint, dtype: str, path: Path, location: str) -> list:
    """Stream every weight into one data file; return TensorProtos that point into it."""
    from onnx import TensorProto

    prepared.check_against(graph, ckpt)
    transpose = transposed(graph)
    torch_dtype = prepared.TORCH_DTYPES[dtype]
    protos = []
    with open(path, "wb") as f:
        for full, p, layer in graph.all_params():
            t = prepared.materialize(p, layer, ckpt, torch_dtype)
            if full in transpose:
                t = t.t()
            t = t.contiguous()
            offset = f.tell()
            offset += -offset % 64  # aligned, so runtimes may map the weights directly
            f.seek(offset)
            raw = t.view(torch.uint8) if t.numel() else t
            f.write(raw.numpy().tobytes())
            proto = TensorProto(name=full, data_type=ONNX_DTYPES[dtype], dims=list(t.shape),
                                data_location=TensorProto.EXTERNAL)
            for key, value in (("location", location), ("offset", str(offset)), ("length", str(t.numel() * t.element_size()))):
                entry = proto.external_data.add()
                entry.key, entry.value = key, value
            protos.append(proto)
        f.flush()
        os.fsync(f.fileno())
    return protos
