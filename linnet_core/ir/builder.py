"""Building a graph op by op, each shape inferred as it goes, verified when finished."""

from __future__ import annotations

from typing import Any

from .graph import Block, CacheLayout, Graph, LayerAttr, Node, Param, Value
from .ops import OPS, infer
from .verify import verify


class GraphBuilder:
    """Builds a Graph op by op, inferring every shape as it goes (see ops.OPS)."""

    def __init__(self, meta: dict[str, Any] | None = None):
        self.inputs: list[Value] = []
        self.params: dict[str, Param] = {}
        self.values: dict[str, Value] = {}
        self.prologue: list[Node] = []
        self.epilogue: list[Node] = []
        self.block: Block | None = None
        self._nodes = self.prologue
        self._params = self.params
        self.meta = meta or {}

    # -- names -------------------------------------------------------------------------------
    def _fresh(self, base: str) -> str:
        name, k = base, 1
        while name in self.values or name in self.params:
            k += 1
            name = f"{base}_{k}"
        return name

    def input(self, name: str, shape: tuple, dtype: str) -> str:
        self.inputs.append(Value(name, shape, dtype))
        self.values[name] = Value(name, shape, dtype)
        return name

    def param(self, name: str, shape: tuple[int, ...], *parts: str, offset: float = 0.0) -> str:
        self._params[name] = Param(name, tuple(shape), tuple(parts), offset)
        return name

    def shape(self, name: str) -> tuple:
        if name in self.values:
            return self.values[name].shape
        if self.block is not None and name in self.block.params:
            return self.block.params[name].shape
        return self.params[name].shape

    # -- ops ---------------------------------------------------------------------------------
    def op(self, op: str, inputs: list[str], out: str | list[str], **attrs: Any):
        """Append a node; returns its output name (or names, when `out` is a list)."""
        shapes = [self.shape(i) for i in inputs]
        layer_free = {k: (self.block.layer_attrs[v.key][0] if isinstance(v, LayerAttr) else v) for k, v in attrs.items()}
        out_shapes = infer(op, shapes, layer_free)
        names = [self._fresh(o) for o in ([out] if isinstance(out, str) else out)]
        for n, s in zip(names, out_shapes, strict=True):
            self.values[n] = Value(n, s, OPS[op].out_dtype)
        self._nodes.append(Node(op, tuple(inputs), tuple(names), attrs))
        return names[0] if isinstance(out, str) else names

    def begin_block(self, count: int, carry: str, **layer_attrs: tuple) -> None:
        self.block = Block(count, carry, layer_attrs={k: tuple(v) for k, v in layer_attrs.items()})
        self._nodes, self._params = self.block.nodes, self.block.params

    def end_block(self, result: str) -> str:
        assert self.block is not None
        self.block.result = result
        self._nodes, self._params = self.epilogue, self.params
        return self.block.carry

    def finish(self, outputs: tuple[str, ...], cache: CacheLayout) -> Graph:
        assert self.block is not None, "a graph needs its decoder block"
        g = Graph(self.inputs, self.params, self.prologue, self.block, self.epilogue, outputs, self.values, cache, self.meta)
        verify(g)
        return g
