"""The walk every graph-to-graph emitter shares (ONNX, StableHLO): nodes in order, the layer
block unrolled once per layer, one lowering function per op looked up in a table."""

from __future__ import annotations

from typing import Any, Callable

from ..errors import IRError
from ..ir.graph import Graph, LayerAttr, Node
from ..ir.ops import OPS


class Lowering:
    """Holds what the op functions share: `env` maps IR values and full weight names to the
    target's values; `layer` is the layer being unrolled (None outside the block)."""

    emitter = "?"  # named in errors

    def __init__(self, g: Graph, table: dict[str, Callable[[Any, Node, list], list]]):
        self.g, self.table = g, table
        self.env: dict[str, Any] = {}
        self.layer: int | None = None

    def value(self, name: str) -> Any:
        if self.layer is not None and name in self.g.block.params:
            name = self.g.block_param_name(name, self.layer)
        return self.env[name]

    def attr(self, n: Node, key: str):
        v = n.attrs[key] if key in n.attrs else OPS[n.op].defaults[key]
        return self.g.block.layer_attrs[v.key][self.layer] if isinstance(v, LayerAttr) else v

    def _lower(self, nodes: list[Node]) -> None:
        for n in nodes:
            fn = self.table.get(n.op)
            if fn is None:
                raise IRError(f"the {self.emitter} emitter has no lowering for op '{n.op}'")
            outs = fn(self, n, [self.value(i) for i in n.inputs])
            for name, out in zip(n.outputs, outs, strict=True):
                self.env[name] = out

    def run(self) -> list[Any]:
        """Lower the whole graph; returns the target values of the graph's outputs."""
        g = self.g
        self._lower(g.prologue)
        for i in range(g.block.count):
            self.layer = i
            self._lower(g.block.nodes)
            self.env[g.block.carry] = self.env[g.block.result]
        self.layer = None
        self._lower(g.epilogue)
        return [self.env[o] for o in g.outputs]
