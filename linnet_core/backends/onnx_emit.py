"""Emitter: Linnet IR -> an ONNX model, written directly with `onnx` (no tracing).

One graph serves prefill and decode (dynamic B and T) over a static KV cache held as one input
and one output per layer and per K/V, `[rows, kv_heads, cache_len, head_dim]`: bind each output
to its input's buffer and ScatterND updates the cache in place. The next token is an output
(ArgMax in the graph), so a greedy step moves B integers to the host, never the logits.

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

    def __init__(self, g: Graph, b: OnnxGraphBuilder, dtype: str):
        super().__init__(g, LOWERINGS)
        self.b, self.dtype = b, dtype
        self.scatter_idx: str | None = None
        self.masks: dict[object, str] = {}


OnnxLowering = Callable[[_Lowering, Node, list[str]], list[str]]


def _positions(L: _Lowering, n: Node, x: list[str]) -> list[str]:
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
    """ScatterND indices [B, T, KV, 3] = (slot, head, position) for cache [rows, KV, S, D]."""
    if L.scatter_idx is None:
        b = L.b
        shape = b.op("Concat", [b.op("Shape", [pos]), b.const([kv_heads, 1])], axis=0)  # [B, T, KV, 1]
        slot = b.op("Expand", [b.op("Unsqueeze", [slots, b.const([1, 2, 3])]), shape])
        heads = b.op("Expand", [b.const(np.arange(kv_heads).reshape(1, 1, kv_heads, 1)), shape])
        position = b.op("Expand", [b.op("Unsqueeze", [pos, b.const([2, 3])]), shape])
        L.scatter_idx = b.op("Concat", [slot, heads, position], "cache_index", axis=-1)
    return L.scatter_idx


def _mask(L: _Lowering, pos: str, window) -> str:
    """Additive mask [B, 1, 1, T, kv_len]: 0 where a query may see a key, -inf elsewhere."""
    if window not in L.masks:
        b = L.b
        key_pos = b.op("Range", [b.const(0), b.op("Squeeze", ["kv_len", b.const([0])]), b.const(1)])  # [L]
        q_pos = b.op("Unsqueeze", [pos, b.const([2])])  # [B, T, 1]
        allowed = b.op("LessOrEqual", [key_pos, q_pos])  # causal; also hides stale cache entries
        if window is not None:
            allowed = b.op("And", [allowed, b.op("Greater", [key_pos, b.op("Sub", [q_pos, b.const(window)])])])
        bias = b.op("Where", [allowed, b.act_const(0.0), b.act_const(-np.inf)])  # [B, T, L]
        L.masks[window] = b.op("Unsqueeze", [bias, b.const([1, 2])], f"mask_w{window}")
    return L.masks[window]


def _attention(L: _Lowering, n: Node, x: list[str]) -> list[str]:
    b, g, i = L.b, L.g, L.layer
    q_shape, k_shape = g.values[n.inputs[0]].shape, g.values[n.inputs[1]].shape
    heads, kv_heads, hd = q_shape[2], k_shape[2], q_shape[3]
    q, k, v, pos, slots = x
    idx = _scatter_indices(L, pos, slots, kv_heads)
    attended = []
    for kind, new in (("k", k), ("v", v)):
        cache = b.op("ScatterND", [f"{kind}_cache.{i}", idx, new], f"{kind}_cache_out.{i}")
        # Only the first kv_len positions, then only this step's rows: [B, KV, L, D]
        span = b.op("Slice", [cache, b.const([0]), "kv_len", b.const([2])])
        rows = b.op("Gather", [span, slots], axis=0)
        attended.append(b.op("Unsqueeze", [rows, b.const([2])]))  # [B, KV, 1, L, D]
    keys, values = attended
    group = heads // kv_heads
    q5 = b.op("Reshape", [b.op("Transpose", [q], perm=[0, 2, 1, 3]), b.const([0, kv_heads, group, -1, hd])])
    scores = b.op("MatMul", [q5, b.op("Transpose", [keys], perm=[0, 1, 2, 4, 3])])  # [B, KV, G, T, L]
    scores = b.op("Add", [b.op("Mul", [scores, b.act_const(L.attr(n, "scale"))]), _mask(L, pos, L.attr(n, "window"))])
    if L.dtype != "float32":  # softmax in float32, as the reference does
        probs = b.op("Cast", [b.op("Softmax", [b.op("Cast", [scores], to=1)], axis=-1)], to=ONNX_DTYPES[L.dtype])
    else:
        probs = b.op("Softmax", [scores], axis=-1)
    out = b.op("MatMul", [probs, values])  # [B, KV, G, T, D]
    out = b.op("Reshape", [out, b.const([0, heads, -1, hd])])  # [B, H, T, D]
    return [b.op("Transpose", [out], perm=[0, 2, 1, 3])]


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
    "last_token": lambda L, n, x: [L.b.op("Slice", [x[0], "logits_from", L.b.const([INT64_MAX]), L.b.const([1])])],
    "argmax": lambda L, n, x: [L.b.op(
        "ArgMax", [L.b.op("Squeeze", [L.b.op("Slice", [x[0], L.b.const([-1]), L.b.const([INT64_MAX]), L.b.const([1])]),
                                      L.b.const([1])])], axis=-1, keepdims=0)],
}


def transposed(graph: Graph) -> set[str]:
    """Full names of the 2-D weights that feed MatMul, stored transposed ([in, out])."""
    names = prepared.linear_weights(graph)
    return set(names["global"]) | {graph.block_param_name(n, i) for i in range(graph.block.count) for n in names["block"]}


def interface(graph: Graph, dtype: str, cache_len: int) -> dict:
    """The entry point's names, shapes and cache layout, for people who run the graph elsewhere."""
    c = graph.cache
    return {
        "format": "linnet-onnx/1",
        "linnet": __version__,
        "opset": OPSET,
        "dtype": dtype,
        "cache_len": cache_len,
        "entry": "one graph for prefill (T tokens of one row) and batched decode (one token for each of B rows)",
        "inputs": {
            "ids": ["B", "T", "int64"],
            "start": ["B", "int64", "first position of this step in each row"],
            "slots": ["B", "int64", "cache row of each batch entry"],
            "kv_len": [1, "int64", "positions to attend over: max(start + T)"],
            "logits_from": [1, "int64", "first position whose logits are returned: T-1 for the last only, 0 for all"],
        },
        "outputs": {"next_token": ["B", "int64", "greedy choice at the last position"],
                    "logits": ["B", "T'", graph.meta["spec"]["vocab_size"], dtype]},
        "cache": {
            "layout": ["rows", "kv_heads", "cache_len", "head_dim"],
            "per_layer": [f"k_cache.{i}" for i in range(c.layers)] + [f"v_cache.{i}" for i in range(c.layers)],
            "outputs": "k_cache_out.<i>, v_cache_out.<i>: bind each to its input's buffer to update in place",
            "layers": c.layers, "kv_heads": c.kv_heads, "head_dim": c.head_dim,
        },
    }


def emit_onnx(graph: Graph, ckpt: Checkpoint, dtype: str, cache_len: int, out: Path,
              model_name: str = "model.onnx") -> dict:
    """Write `model.onnx` and its external weights into `out`; returns the interface JSON."""
    onnx = require_onnx()
    from onnx import TensorProto, helper

    if dtype not in ONNX_DTYPES:
        raise IRError(f"the ONNX emitter has no dtype '{dtype}'")
    verify(graph)
    b = OnnxGraphBuilder(dtype)
    L = _Lowering(graph, b, dtype)
    elem = ONNX_DTYPES[dtype]
    c = graph.cache
    inputs = [
        helper.make_tensor_value_info("ids", TensorProto.INT64, ["B", "T"]),
        helper.make_tensor_value_info("start", TensorProto.INT64, ["B"]),
        helper.make_tensor_value_info("slots", TensorProto.INT64, ["B"]),
        helper.make_tensor_value_info("kv_len", TensorProto.INT64, [1]),
        helper.make_tensor_value_info("logits_from", TensorProto.INT64, [1]),
    ]
    for kind in ("k", "v"):
        inputs += [helper.make_tensor_value_info(f"{kind}_cache.{i}", elem, ["rows", c.kv_heads, cache_len, c.head_dim])
                   for i in range(c.layers)]
    for name in ("ids", "start", "slots", "kv_len", "logits_from"):
        b._names.add(name)
    for name in [v.name for v in graph.inputs] + [full for full, _, _ in graph.all_params()]:
        L.env[name] = name  # graph inputs and weight initializers keep their names

    next_token, logits = L.run()
    b.nodes.append(helper.make_node("Identity", [next_token], ["next_token"], name="out_next_token"))
    b.nodes.append(helper.make_node("Identity", [logits], ["logits"], name="out_logits"))
    outputs = [helper.make_tensor_value_info("next_token", TensorProto.INT64, ["B"]),
               helper.make_tensor_value_info("logits", elem, ["B", "Tout", graph.meta["spec"]["vocab_size"]])]
    for kind in ("k", "v"):
        outputs += [helper.make_tensor_value_info(f"{kind}_cache_out.{i}", elem,
                                                  ["rows", c.kv_heads, cache_len, c.head_dim]) for i in range(c.layers)]

    weights = _write_external_weights(graph, ckpt, dtype, out / f"{model_name}.data", f"{model_name}.data")
    g = helper.make_graph(b.nodes, "linnet", inputs, outputs, initializer=b.initializers + weights)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="linnet",
                              producer_version=__version__)
    model.ir_version = 10  # what ONNX Runtime 1.20+ reads; opset 23 needs >= 10
    onnx.save_model(model, str(out / model_name))
    info = interface(graph, dtype, cache_len)
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
