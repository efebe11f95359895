"""The IR verifier: run after every build and pass, and before every emit.

It checks what emitters rely on without re-checking: known ops with the right arity and
attributes, every input defined before use (SSA, with the block's carry), weights that exist
with the shapes the ops need, per-layer attributes with one value per layer, recorded shapes
and dtypes equal to the inferred ones, the KV cache layout agreeing with the attention ops, and
a step form (dense or ragged) that every attention and last_token node agrees with.
"""

from __future__ import annotations

from ..errors import IRError
from .graph import Graph, LayerAttr, Node, Param
from .ops import OPS, infer


def verify(g: Graph) -> None:
    defined: set[str] = {v.name for v in g.inputs}
    if len(defined) != len(g.inputs):
        raise IRError("graph inputs have duplicate names")
    for v in g.inputs:
        recorded = g.values.get(v.name)
        if v.dtype != "i64" or recorded is None or (tuple(recorded.shape), recorded.dtype) != (tuple(v.shape), v.dtype):
            raise IRError(f"graph input '{v.name}' must be an i64 value recorded as declared")

    def check(nodes: list[Node], params: dict[str, Param], scope: set[str], in_block: bool, where: str) -> None:
        for idx, n in enumerate(nodes):
            at = f"{where} node {idx} ({n.op})"
            if n.op not in OPS:
                raise IRError(f"{at}: unknown op")
            if OPS[n.op].in_block_only and not in_block:
                raise IRError(f"{at}: only allowed inside the layer block")
            shapes = []
            for i in n.inputs:
                if i in scope:
                    shapes.append(g.values[i].shape)
                elif i in params:
                    shapes.append(params[i].shape)
                else:
                    raise IRError(f"{at}: input '{i}' is used before it is defined")
            attrs = {}
            for k, v in n.attrs.items():
                if isinstance(v, LayerAttr):
                    if not in_block:
                        raise IRError(f"{at}: per-layer attribute '{k}' outside the block")
                    values = g.block.layer_attrs.get(v.key)
                    if values is None or len(values) != g.block.count:
                        raise IRError(f"{at}: per-layer attribute '{v.key}' needs {g.block.count} values")
                    v = values[0]
                attrs[k] = v
            try:
                out_shapes = infer(n.op, shapes, attrs)
            except IRError as e:
                raise IRError(f"{at}: {e.message}") from None
            if len(out_shapes) != len(n.outputs):
                raise IRError(f"{at}: {len(n.outputs)} outputs named, op gives {len(out_shapes)}")
            for o, s in zip(n.outputs, out_shapes):
                if o in scope or o in params:
                    raise IRError(f"{at}: output '{o}' is defined twice")
                if o not in g.values or tuple(g.values[o].shape) != tuple(s):
                    raise IRError(f"{at}: recorded shape of '{o}' disagrees with the inferred {s}")
                if g.values[o].dtype != OPS[n.op].out_dtype:
                    raise IRError(f"{at}: recorded dtype of '{o}' is {g.values[o].dtype}, the op gives "
                                  f"{OPS[n.op].out_dtype}")
                scope.add(o)
            if n.op in ("attention", "last_token") and bool(attrs.get("ragged")) != g.ragged:
                raise IRError(f"{at}: a {'ragged' if g.ragged else 'dense'} graph has a node of the other step form")
            if n.op == "attention":
                k_shape = g.values[n.inputs[1]].shape
                if (k_shape[2], k_shape[3]) != (g.cache.kv_heads, g.cache.head_dim):
                    raise IRError(f"{at}: keys {k_shape} do not match the cache layout {g.cache}")

    check(g.prologue, g.params, defined, False, "prologue")
    b = g.block
    if b.count < 1 or b.carry not in defined:
        raise IRError(f"block: carry '{b.carry}' undefined or no layers")
    if g.cache.layers != b.count:
        raise IRError(f"cache has {g.cache.layers} layers, block {b.count}")
    block_scope = set(defined)
    check(b.nodes, {**g.params, **b.params}, block_scope, True, "block")
    if b.result not in block_scope or g.values[b.result].shape != g.values[b.carry].shape:
        raise IRError(f"block: result '{b.result}' is undefined or not shaped like the carry '{b.carry}'")
    check(g.epilogue, g.params, defined, False, "epilogue")
    for o in g.outputs:
        if o not in defined:
            raise IRError(f"graph output '{o}' is never computed")
    used = {i for n in g.prologue + b.nodes + g.epilogue for i in n.inputs}
    unused = [p for p in list(g.params) + list(b.params) if p not in used]
    if unused:
        raise IRError(f"weights never used: {', '.join(unused)}")
