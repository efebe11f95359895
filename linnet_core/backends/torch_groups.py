"""Groups of an eager step's block nodes that one helper call computes (pyemit.Group).

At decode every tensor between the matmuls is one token's, and each Python-level op's cost is
mostly its first touch of code and data the weights' stream has just evicted (~20 ms of a 225 ms
step at Qwen3-4B's shape). So the ragged torch step renders three patterns as one helper call each,
which a kernel serves (cpu/step_kernels.py's StepKernels) or which runs the nodes' own lines:
- `attention_block`: split of the fused q/k/v projection, the heads' reshapes, optional q/k norms,
  both ropes, the attention and the reshape after it;
- `silu_mul`: split of the fused gate/up projection into halves, silu of the first, times the second;
- `add_rms_norm`: a residual add and the norm that reads it.
A pattern matches only where its intermediate values have no other use, so nothing else changes.
"""

from __future__ import annotations

from collections import defaultdict

from ..ir.graph import Graph, Node
from .pyemit import Group, Raw, Ref


class _Block:
    """The block's nodes with who produces and who reads each value."""

    def __init__(self, g: Graph):
        self.g, self.nodes = g, g.block.nodes
        self.producer = {o: n for n in self.nodes for o in n.outputs}
        self.readers: dict[str, list[Node]] = defaultdict(list)
        for n in self.nodes:
            for i in n.inputs:
                self.readers[i].append(n)

    def made_by(self, value: str, op: str) -> Node | None:
        n = self.producer.get(value)
        return n if n is not None and n.op == op else None

    def only_read_by(self, value: str, node: Node) -> bool:
        return value != self.g.block.result and [id(r) for r in self.readers[value]] == [id(node)]


def _silu_mul(b: _Block, mul: Node) -> Group | None:
    """mul(silu(gate), up) with gate, up the halves of one split."""
    if mul.op != "mul":
        return None
    for act, up in (mul.inputs, mul.inputs[::-1]):
        silu = b.made_by(act, "silu")
        split = b.made_by(silu.inputs[0], "split") if silu else None
        if split is None or split.outputs != (silu.inputs[0], up) or len(set(split.attrs["sizes"])) != 1:
            continue
        if all(b.only_read_by(v, n) for v, n in ((act, mul), (up, mul), (silu.inputs[0], silu))):
            return Group((split, silu, mul), mul.outputs, "silu_mul", (Ref(split.inputs[0]),))
    return None


def _add_rms_norm(b: _Block, norm: Node) -> Group | None:
    """rms_norm(x + y) that keeps x + y (the residual stream) for later."""
    add = b.made_by(norm.inputs[0], "add") if norm.op == "rms_norm" else None
    if add is None or norm.inputs[1] not in b.g.block.params:
        return None
    x, y = add.inputs
    return Group((add, norm), add.outputs + norm.outputs, "add_rms_norm",
                 (Ref(x), Ref(y), Ref(norm.inputs[1]), norm.attrs["eps"]))


def _attention_block(b: _Block, att: Node) -> Group | None:
    """split(qkv) -> reshapes -> [rms_norm q / k] -> rope q, k -> ragged attention -> reshape."""
    if att.op != "attention" or not att.attrs.get("ragged") or att.attrs.get("softcap") is not None:
        return None  # the kernel has no soft cap: soft-capped attention keeps its lines
    q_rot, k_rot, v_heads, pos, slots, *index = att.inputs
    rq, rk = b.made_by(q_rot, "rope"), b.made_by(k_rot, "rope")
    flat = b.readers[att.outputs[0]]
    if rq is None or rk is None or rq.inputs[1:] != rk.inputs[1:] or len(flat) != 1 or flat[0].op != "reshape":
        return None
    if rq.attrs.get("apply", True) != rk.attrs.get("apply", True):  # one rope switch serves both
        return None
    norms, heads = [], []
    for x in (rq.inputs[0], rk.inputs[0]):
        norm = b.made_by(x, "rms_norm")
        norms.append(norm)
        heads.append(norm.inputs[0] if norm else x)
    heads.append(v_heads)
    reshapes = [b.made_by(h, "reshape") for h in heads]
    if None in reshapes:
        return None
    split = b.made_by(reshapes[0].inputs[0], "split")
    if split is None or split.outputs != tuple(r.inputs[0] for r in reshapes):
        return None
    epss = {n.attrs["eps"] for n in norms if n is not None}
    (H, D), KV = b.g.values[heads[0]].shape[-2:], b.g.values[heads[1]].shape[-2]
    if (len(epss) > 1 or any(n is not None and n.inputs[1] not in b.g.block.params for n in norms)
            or split.attrs["sizes"] != [H * D, KV * D, KV * D] or D != b.g.cache.head_dim
            or b.g.values[flat[0].outputs[0]].shape != (1, "N", H * D)):
        return None
    chain = [split, *reshapes, *(n for n in norms if n is not None), rq, rk, att, flat[0]]
    members = {id(n) for n in chain}
    inner = [(v, n) for n in chain[1:] for v in n.inputs if v in b.producer and id(b.producer[v]) in members]
    if not all(b.only_read_by(v, n) for v, n in inner):
        return None
    args = (Ref(split.inputs[0]), H, KV, D, *(Ref(n.inputs[1]) if n else None for n in norms),
            next(iter(epss), None), *(Ref(v) for v in (*rq.inputs[1:], pos, slots, *index)),
            Raw("k_cache"), Raw("v_cache"), Raw("i"), att.attrs.get("window"), att.attrs["scale"],
            rq.attrs.get("apply", True))
    return Group(tuple(chain), flat[0].outputs, "attention_block", args)


MATCHERS = (_attention_block, _silu_mul, _add_rms_norm)


def groups(g: Graph) -> list:
    """The block's nodes in order, each matched group in place of its nodes (at its first node: every
    input from outside the group is a weight, a step input or an earlier node's output)."""
    b = _Block(g)
    found: dict[int, Group] = {}  # id of the group's first node -> the group
    taken: set[int] = set()
    for n in b.nodes:
        for match in MATCHERS:
            gr = match(b, n)
            if gr is None or taken & {id(m) for m in gr.nodes}:
                continue
            order = sorted(b.nodes.index(m) for m in gr.nodes)
            inside = {o for m in gr.nodes for o in m.outputs}
            earlier = {o for m in b.nodes[:order[0]] for o in m.outputs}
            outside = {i for m in gr.nodes for i in m.inputs if i not in inside}
            if any(i in b.producer and i not in earlier for i in outside):
                continue
            found[id(b.nodes[order[0]])] = gr
            taken |= {id(m) for m in gr.nodes}
    out: list = []
    for n in b.nodes:
        if id(n) in found:
            out.append(found[id(n)])
        elif id(n) not in taken:
            out.append(n)
    return out
