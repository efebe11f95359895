"""Emitting readable Python modules from the IR: one line per IR node, shapes in the comments.

A Dialect (generated PyTorch, generated JAX) is a prelude of helper kernels, an op -> template
table and the step function's frame, for one step form (dense or ragged: see ir.ragged); this
module renders any of them the same way. Each
template may use {out} (the outputs), {a} {b} (the first inputs), {args} (all inputs) and
{<attr>} (each attribute; a per-layer one indexes its table with the loop's `i`). An op without
a template fails at emit time, naming it. Output is deterministic (golden copies are kept).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

from .. import __version__
from ..errors import CheckpointError, IRError
from ..ir.graph import Graph, LayerAttr, Node
from ..ir.ops import OPS
from ..ir.rope import inv_freq
from ..ir.verify import verify


@dataclass(frozen=True)
class Dialect:
    name: str  # for messages and the docstring: "PyTorch", "JAX"
    prelude: str  # imports and helper kernels
    templates: dict[str, str]
    array: str  # how a float32 constant array is written: "torch.tensor" / "jnp.array"
    float32: str  # "torch.float32" / "jnp.float32"
    contract: tuple[str, ...]  # docstring lines describing step()
    signature: str  # "def step(...):", where {inputs} are the graph's inputs in order
    setup: tuple[str, ...]  # the step's first lines
    loop: str  # the layer loop's header
    returns: str  # the step's last line
    ragged: bool = False  # the step form it renders
    groups: Callable[[Graph], list] | None = None  # the block's nodes and Groups, where some render as one call
    frees: bool = False  # `del` each layer value after its last read (eager dialects: a step's peak memory)


@dataclass(frozen=True)
class Raw:
    """A name of the step function itself (k_cache, the loop's i), rendered as it is."""

    text: str


@dataclass(frozen=True)
class Ref:
    """An IR value or weight, rendered as the step refers to it."""

    name: str


@dataclass(frozen=True)
class Group:
    """Consecutive-in-effect nodes of the block that one helper call computes (what each node's line
    computes, in one call where a kernel serves them): `outputs = helper(*args, kernels)`. Args are
    Refs, Raws or attribute values."""

    nodes: tuple[Node, ...]
    outputs: tuple[str, ...]  # the values used after the group
    helper: str
    args: tuple[Any, ...]


def inv_freq_name(k: int) -> str:
    """The module constant of the graph's k-th rope table's inverse frequencies."""
    return "ROPE_INV_FREQ" if k == 0 else f"ROPE_INV_FREQ_{k + 1}"


class _Ctx:
    def __init__(self, g: Graph | None, in_block: bool):
        self.g, self.in_block = g, in_block
        tables = [n for n in g.prologue if n.op == "rope_table"] if g is not None else []
        self.tables = {id(n): inv_freq_name(k) for k, n in enumerate(tables)}

    def ref(self, name: str) -> str:
        if self.g is None:  # a node on its own: every input is a local name
            return name
        if self.in_block and name in self.g.block.params:
            return f'w["{name}"]'
        if name in self.g.params:
            return f'g["{name}"]'
        return name

    @staticmethod
    def attr(v) -> str:
        if isinstance(v, LayerAttr):
            return f"{v.key.upper()}[i]"
        if isinstance(v, list) and any(isinstance(d, str) for d in v):  # a shape with symbols B, T
            return ", ".join(str(d) for d in v)
        return float_literal(v) if isinstance(v, float) else repr(v)


def float_literal(v: float) -> str:
    """`repr` of a finite float: the one form a number from a model's files takes in generated source
    (repr(nan) is the bare name `nan`, which fails the import). The config readers refuse non-finite
    values first; this holds the line for any that a derived value (a frequency) could still make."""
    if not math.isfinite(v):
        raise CheckpointError(f"the model's settings give a non-finite number ({v}) where the generated code needs one",
                              hint="check the rope and norm values in the checkpoint's config or GGUF metadata")
    return repr(float(v))


def _shape(s: tuple) -> str:
    return "[" + ", ".join(str(d) for d in s) + "]"


def _render(n: Node, ctx: _Ctx, d: Dialect) -> str:
    template = d.templates.get(n.op)
    if template is None:
        raise IRError(f"the {d.name} emitter has no template for op '{n.op}'")
    refs = [ctx.ref(i) for i in n.inputs]
    line = template.format(
        out=", ".join(n.outputs), a=refs[0], b=refs[1] if len(refs) > 1 else "", args=", ".join(refs),
        inv_freq=ctx.tables.get(id(n), inv_freq_name(0)),
        **{k: ctx.attr(v) for k, v in {**OPS[n.op].defaults, **n.attrs}.items()},
    )
    gate = n.attrs.get("apply", True)
    if gate is True:
        return line
    # An op some layers skip (`apply` false there) passes its first input through on those layers.
    lhs, rhs = line.split(" = ", 1)
    return f"{lhs} = {rhs} if {ctx.attr(gate)} else {refs[0]}"


def render_node(n: Node, d: Dialect) -> str:
    """One node as a statement over local names (the per-op conformance tests run these)."""
    return _render(n, _Ctx(None, True), d)


def _render_group(gr: Group, ctx: _Ctx) -> str:
    args = [ctx.ref(a.name) if isinstance(a, Ref) else a.text if isinstance(a, Raw) else ctx.attr(a) for a in gr.args]
    return f"{', '.join(gr.outputs)} = {gr.helper}({', '.join(args + ['kernels'])})"


def _reads(item) -> list[str]:
    if isinstance(item, Group):
        return [a.name for a in item.args if isinstance(a, Ref)]
    return list(item.inputs)


def _last_reads(items: list, carry: str, result: str) -> list[list[str]]:
    """Per line of the layer body, the values of the iteration (the carry and what the body defines;
    not the result, which the carry takes) that no later line reads: freed after it. Python would
    otherwise hold every layer temporary until the next iteration rebinds its name, so a step over a
    burst of prompt tokens held all of them at once (a 771-token step: ~60 MiB at the 191M shape)."""
    owned, last = {carry}, {}
    for k, item in enumerate(items):
        for name in _reads(item):
            if name in owned:
                last[name] = k
        for name in item.outputs:
            owned.add(name)
            last.setdefault(name, k)  # never read: freed where it is made
    frees: list[list[str]] = [[] for _ in items]
    for name, k in last.items():
        if name != result:
            frees[k].append(name)
    return [sorted(f) for f in frees]


def _lines(nodes: list, g: Graph, ctx: _Ctx, d: Dialect, indent: str, frees: list[list[str]] | None = None) -> list[str]:
    out = []
    for k, n in enumerate(nodes):
        shapes = "; ".join(_shape(g.values[o].shape) for o in n.outputs)
        if isinstance(n, Group):
            ops = [m.op for m in n.nodes]
            counted = ", ".join(op if ops.count(op) == 1 else f"{op} x{ops.count(op)}" for op in dict.fromkeys(ops))
            out.append(f"{indent}{_render_group(n, ctx)}  # {shapes}: {counted}")
        else:
            out.append(f"{indent}{_render(n, ctx, d)}  # {shapes}")
        if frees and frees[k]:
            out.append(f"{indent}del {', '.join(frees[k])}")
    return out


def emit_module(g: Graph, d: Dialect) -> str:
    """The module's source text for graph `g` in dialect `d` (the graph is verified first)."""
    verify(g)
    if g.ragged != d.ragged:
        form = "ragged" if g.ragged else "dense"
        raise IRError(f"the {d.name} emitter has no {form} step form (its dialect renders "
                      f"{'ragged' if d.ragged else 'dense'} steps)")
    meta, c = g.meta, g.cache
    spec = meta.get("spec", {})
    fmt = dict(layers=c.layers, kv_heads=c.kv_heads, head_dim=c.head_dim)
    head = [
        f'"""Generated by Linnet {__version__} from the IR of a {meta.get("model_type")} checkpoint '
        f"({g.block.count} layers, hidden {spec.get('hidden_size')}, vocab {spec.get('vocab_size')}).",
        "",
        *(line.format(**fmt) for line in d.contract),
        "Regenerated from the IR on every compile: change the emitter, not this file.",
        '"""',
    ]
    body = [d.prelude.strip("\n"), "", ""]
    for k, node in enumerate(n for n in g.prologue if n.op == "rope_table"):
        freqs = inv_freq(node.attrs["rope"], node.attrs["rotary_dim"])
        rows = [", ".join(float_literal(float(f)) for f in freqs[j:j + 4]) for j in range(0, len(freqs), 4)]
        body.append(f"{inv_freq_name(k)} = {d.array}([  # [{len(freqs)}] inverse frequencies, "
                    f"{node.attrs['rope']['type']} rope")
        body += [f"    {r}," for r in rows]
        body.append(f"], dtype={d.float32})")
    for key, values in g.block.layer_attrs.items():
        body.append(f"{key.upper()} = {tuple(values)!r}  # per layer")
    body += ["", "", d.signature.format(inputs=", ".join(v.name for v in g.inputs))]
    body += [f"    {line}" for line in d.setup]
    body += _lines(g.prologue, g, _Ctx(g, False), d, "    ")
    body.append(f"    {d.loop}")
    block = d.groups(g) if d.groups else g.block.nodes
    frees = _last_reads(block, g.block.carry, g.block.result) if d.frees else None
    body += _lines(block, g, _Ctx(g, True), d, "        ", frees)
    body.append(f"        {g.block.carry} = {g.block.result}")
    body += _lines(g.epilogue, g, _Ctx(g, False), d, "    ")
    body.append(f"    {d.returns.format(outputs=', '.join(g.outputs))}")
    return "\n".join(head + body) + "\n"
