"""The Linnet IR: a prologue, one decoder block repeated per layer, and an epilogue.

Keeping the repeated block as one body (rather than unrolling L copies) gives emitters a loop
or a scan for free and keeps generated code short. A graph computes one step for B cache rows:
inputs `ids [B,T]`, `start [B]` (the first position of the step in each row) and `slots [B]`
(which cache rows), against a static KV cache `[layers, rows, kv_heads, cache_len, head_dim]`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .ops import OPS


@dataclass(frozen=True)
class LayerAttr:
    """An attribute whose value differs per layer; the values live in `Block.layer_attrs`."""

    key: str


@dataclass
class Value:
    name: str
    shape: tuple
    dtype: str  # "act" (the compile dtype) or "i64" (ids, positions, rows); checked by the verifier


@dataclass
class Node:
    op: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attrs: dict[str, Any] = field(default_factory=dict)


@dataclass
class Param:
    """A weight: concatenation on axis 0 of checkpoint tensors (`{i}` is the layer index), plus `offset`
    (Gemma's norms scale by 1 + the stored weight; llama.cpp's files store the sum, as this holds it)."""

    name: str
    shape: tuple[int, ...]
    parts: tuple[str, ...]
    offset: float = 0.0

    def sources(self, layer: int | None = None) -> list[str]:
        return [p.format(i=layer) if layer is not None else p for p in self.parts]


@dataclass
class Block:
    count: int
    carry: str  # the value that enters each layer and is replaced by `result`
    result: str = ""
    params: dict[str, Param] = field(default_factory=dict)
    nodes: list[Node] = field(default_factory=list)
    layer_attrs: dict[str, tuple] = field(default_factory=dict)


@dataclass(frozen=True)
class CacheLayout:
    layers: int
    kv_heads: int
    head_dim: int


@dataclass
class Graph:
    inputs: list[Value]
    params: dict[str, Param]
    prologue: list[Node]
    block: Block
    epilogue: list[Node]
    outputs: tuple[str, ...]
    values: dict[str, Value]
    cache: CacheLayout
    meta: dict[str, Any] = field(default_factory=dict)

    def block_param_name(self, local: str, layer: int) -> str:
        return f"blk.{layer}.{local}"

    def all_params(self) -> list[tuple[str, Param, int | None]]:
        """(full name, param, layer) for every weight, in a stable order."""
        out: list[tuple[str, Param, int | None]] = [(n, p, None) for n, p in self.params.items()]
        for i in range(self.block.count):
            out += [(self.block_param_name(n, i), p, i) for n, p in self.block.params.items()]
        return out

    def to_json(self) -> dict[str, Any]:
        def node(n: Node) -> dict:
            attrs = {k: ({"layer_attr": v.key} if isinstance(v, LayerAttr) else v) for k, v in n.attrs.items()}
            return {"op": n.op, "in": list(n.inputs), "out": list(n.outputs), "attrs": attrs}

        def params(ps: dict[str, Param]) -> dict:
            return {n: {"shape": list(p.shape), "parts": list(p.parts), **({"offset": p.offset} if p.offset else {})}
                    for n, p in ps.items()}

        return {
            "meta": self.meta,
            "inputs": [{"name": v.name, "shape": list(v.shape), "dtype": v.dtype} for v in self.inputs],
            "params": params(self.params),
            "prologue": [node(n) for n in self.prologue],
            "block": {
                "count": self.block.count,
                "carry": self.block.carry,
                "result": self.block.result,
                "params": params(self.block.params),
                "nodes": [node(n) for n in self.block.nodes],
                "layer_attrs": {k: list(v) for k, v in self.block.layer_attrs.items()},
            },
            "epilogue": [node(n) for n in self.epilogue],
            "outputs": list(self.outputs),
            "values": {n: {"shape": list(v.shape), "dtype": v.dtype} for n, v in self.values.items()},
            "cache": vars(self.cache),
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Graph":
        """The graph `to_json` wrote (ir.verify checks it: backends.artifact.read_graph does)."""
        def node(n: dict) -> Node:
            attrs = {k: (LayerAttr(v["layer_attr"]) if isinstance(v, dict) and "layer_attr" in v else v)
                     for k, v in n["attrs"].items()}
            return Node(n["op"], tuple(n["in"]), tuple(n["out"]), attrs)

        def params(ps: dict) -> dict[str, Param]:
            return {n: Param(n, tuple(p["shape"]), tuple(p["parts"]), p.get("offset", 0.0)) for n, p in ps.items()}

        blk = d["block"]
        block = Block(blk["count"], blk["carry"], blk["result"], params(blk["params"]), [node(n) for n in blk["nodes"]],
                      {k: tuple(v) for k, v in blk["layer_attrs"].items()})
        return cls(
            inputs=[Value(v["name"], tuple(v["shape"]), v["dtype"]) for v in d["inputs"]],
            params=params(d["params"]),
            prologue=[node(n) for n in d["prologue"]],
            block=block,
            epilogue=[node(n) for n in d["epilogue"]],
            outputs=tuple(d["outputs"]),
            values={n: Value(n, tuple(v["shape"]), v["dtype"]) for n, v in d["values"].items()},
            cache=CacheLayout(**d["cache"]),
            meta=d["meta"],
        )

    @property
    def ragged(self) -> bool:
        """Whether the graph takes ragged steps (see ir.ragged.to_ragged)."""
        return self.meta.get("step") == "ragged"


__all__ = ["Block", "CacheLayout", "Graph", "LayerAttr", "Node", "OPS", "Param", "Value"]
