"""The ragged step as a graph pass: one step of N tokens from any mix of cache rows.

A dense graph runs B rows of T tokens each (`ids [B, T]`, `start [B]`, `slots [B]`). Its ragged
form takes the step's tokens packed (`ids [1, N]`) with each token's position and row, so the
linear layers run over all N tokens at once while attention runs in two groups: the one-token
rows (decoding) and the multi-token chunks (prompt pieces) padded to one length. That is how a
serving engine lets decode rows ride along with a prompt chunk in one pass over the weights.
`runtime.ragged.ragged_layout` builds these inputs; a backend whose `ragged` capability is set
compiles the graph this pass returns, and `Session` feeds it every step.
"""

from __future__ import annotations

import copy

from ..errors import IRError
from .graph import Graph, LayerAttr, Node, Value
from .ops import infer
from .verify import verify

# name: (shape, meaning); all int64. The order is the graph's (and an emitted entry point's).
RAGGED_INPUTS: dict[str, tuple[tuple, str]] = {
    "ids": ((1, "N"), "the step's tokens: the one-token rows first, then each chunk's tokens"),
    "pos": ((1, "N"), "position of each token in its row"),
    "token_slots": ((1, "N"), "cache row of each token"),
    "d_slots": (("Bd",), "cache row of each one-token row (the first Bd tokens)"),
    "d_kv_len": ((1,), "positions the one-token rows attend over: max(pos + 1), at least 1"),
    "p_slots": (("Bp",), "cache row of each chunk"),
    "p_index": (("Bp", "Tp"), "token index of each chunk position; a short chunk repeats its last token"),
    "p_pack": (("Np",), "for each chunk token in order, its place in the flattened [Bp, Tp]"),
    "p_kv_len": ((1,), "positions the chunks attend over: max(pos + 1), at least 1"),
    "logits_index": (("E",), "tokens whose logits and next token are returned"),
}
DENSE_ONLY_OPS = ("positions",)  # a ragged step's positions are an input
ATTENTION_INDEX = ("d_slots", "d_kv_len", "p_slots", "p_index", "p_pack", "p_kv_len")


def to_ragged(g: Graph) -> Graph:
    """The ragged form of a dense step graph (verified); a ragged graph is returned as it is."""
    if g.ragged:
        return g
    g = copy.deepcopy(g)
    positions = [n for n in g.prologue if n.op in DENSE_ONLY_OPS]
    if len(positions) != 1:
        raise IRError("to_ragged: a step graph has exactly one positions node")
    pos_name = positions[0].outputs[0]
    g.prologue.remove(positions[0])
    rename = {pos_name: "pos", "slots": "token_slots"}

    def rewrite(n: Node) -> Node:
        inputs = tuple(rename.get(i, i) for i in n.inputs)
        attrs = dict(n.attrs)
        if n.op == "attention":
            inputs, attrs["ragged"] = inputs + ATTENTION_INDEX, True
        elif n.op == "last_token":
            inputs, attrs["ragged"] = inputs + ("logits_index",), True
        elif n.op == "reshape":  # [B, T, ...] -> [1, N, ...]
            attrs["shape"] = [{"B": 1, "T": "N"}.get(d, d) if isinstance(d, str) else d for d in attrs["shape"]]
        return Node(n.op, inputs, n.outputs, attrs)

    g.prologue = [rewrite(n) for n in g.prologue]
    g.block.nodes = [rewrite(n) for n in g.block.nodes]
    g.epilogue = [rewrite(n) for n in g.epilogue]
    g.inputs = [Value(name, shape, "i64") for name, (shape, _) in RAGGED_INPUTS.items()]
    g.meta = {**g.meta, "step": "ragged"}
    g.values = _infer_values(g)
    verify(g)
    return g


def _infer_values(g: Graph) -> dict[str, Value]:
    """Every value's shape inferred afresh from the inputs (dtypes kept from the dense graph)."""
    values = {v.name: v for v in g.inputs}
    params = {**g.params, **g.block.params}

    def walk(nodes: list[Node]) -> None:
        for n in nodes:
            shapes = [values[i].shape if i in values else params[i].shape for i in n.inputs]
            attrs = {k: (g.block.layer_attrs[v.key][0] if isinstance(v, LayerAttr) else v) for k, v in n.attrs.items()}
            for o, s in zip(n.outputs, infer(n.op, shapes, attrs), strict=True):
                values[o] = Value(o, s, g.values[o].dtype)

    walk(g.prologue)
    walk(g.block.nodes)
    walk(g.epilogue)
    return values
