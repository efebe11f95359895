"""Graph passes. Each returns a new verified graph and never changes what it computes."""

from __future__ import annotations

import copy

from .graph import Graph, Node, Param
from .verify import verify

# Readable names for the usual fusions; any other group is named by joining its members.
FUSED_NAMES = {("attn_q", "attn_k", "attn_v"): "attn_qkv", ("ffn_gate", "ffn_up"): "ffn_gate_up"}


def fuse_parallel_linears(g: Graph) -> Graph:
    """Merge linears of the block that read the same input into one linear and a split.

    One wide GEMM/GEMV instead of several reads the input once and launches once; the fused
    weight is a concatenation of checkpoint tensors, made when the weights are prepared.
    """
    g = copy.deepcopy(g)
    b = g.block
    groups: dict[tuple[str, bool], list[Node]] = {}
    for n in b.nodes:
        if n.op == "linear" and n.inputs[1] in b.params:
            groups.setdefault((n.inputs[0], len(n.inputs) == 3), []).append(n)
    for (x, has_bias), members in groups.items():
        if len(members) < 2:
            continue
        roles = tuple(m.inputs[1].removesuffix(".weight") for m in members)
        role = FUSED_NAMES.get(roles, "_".join(roles))
        weights = [b.params.pop(m.inputs[1]) for m in members]
        sizes = [w.shape[0] for w in weights]
        wname = f"{role}.weight"
        b.params[wname] = Param(wname, (sum(sizes), weights[0].shape[1]), sum((w.parts for w in weights), ()))
        inputs = [x, wname]
        if has_bias:
            biases = [b.params.pop(m.inputs[2]) for m in members]
            b.params[f"{role}.bias"] = Param(f"{role}.bias", (sum(sizes),), sum((p.parts for p in biases), ()))
            inputs.append(f"{role}.bias")
        fused_out = role
        while fused_out in g.values:
            fused_out += "_"
        first = b.nodes.index(members[0])
        shape = g.values[members[0].outputs[0]].shape[:-1] + (sum(sizes),)
        g.values[fused_out] = type(g.values[x])(fused_out, shape, "act")
        fused = Node("linear", tuple(inputs), (fused_out,))
        split = Node("split", (fused_out,), tuple(m.outputs[0] for m in members), {"sizes": sizes})
        b.nodes = [n for n in b.nodes if n not in members]
        b.nodes[first:first] = [fused, split]
    verify(g)
    return g


DEFAULT_PASSES = (fuse_parallel_linears,)


def optimize(g: Graph, passes=DEFAULT_PASSES) -> Graph:
    for p in passes:
        g = p(g)
    return g
