"""Prepared weights: the graph's params made from checkpoint tensors (concatenated, cast).

Shared by every backend and export. Names and shapes are checked against the checkpoint before
any data is read, so a missing tensor or a shape that disagrees with the config is reported
with the file and tensor named, before an artifact is half-written.
"""

from __future__ import annotations

from typing import Iterator

import torch

from .dtypes import FORMATS, torch_dtype
from .errors import CheckpointError
from .ir.graph import Graph, Param
from .ir.ops import OPS
from .quant import param_formats, quantize, stored_shape
from .weights import Checkpoint


def check_against(graph: Graph, ckpt: Checkpoint) -> None:
    """Every source tensor exists with the shape the graph needs (headers only, no data read)."""
    for _, p, layer in graph.all_params():
        infos = [ckpt.info(src) for src in p.sources(layer)]
        rows = sum(i.shape[0] if i.shape else 0 for i in infos)
        for info in infos:
            if not info.shape or tuple(info.shape[1:]) != p.shape[1:] or (len(infos) == 1 and rows != p.shape[0]):
                implied = list(p.shape) if len(infos) == 1 else ["*", *p.shape[1:]]
                raise CheckpointError(
                    f"{info.file.name}: tensor '{info.name}' has shape {list(info.shape)}, the config implies {implied}"
                )
        if rows != p.shape[0]:
            names = ", ".join(f"'{i.name}'" for i in infos)
            raise CheckpointError(f"{infos[0].file.name}: tensors {names} have {rows} rows together, "
                                  f"the config implies {p.shape[0]}")


def materialize(p: Param, layer: int | None, ckpt: Checkpoint, dtype: torch.dtype, *,
                as_stored: bool = False) -> torch.Tensor:
    """The param's value in `dtype` (`as_stored`: the checkpoint's tensors without the param's offset)."""
    parts = [ckpt.get(s) for s in p.sources(layer)]
    t = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
    if p.offset and not as_stored:  # added in float32, then rounded once, as transformers computes 1 + w
        t = t.float() + p.offset
    return t.to(dtype)


def layout(graph: Graph, dtype: str) -> tuple[list[tuple[str, tuple[int, ...], torch.dtype]], dict[str, str]]:
    """(name, shape, dtype) of every distinct prepared weight in file order, and the aliases.

    Params made from the same tensors in the same format (a tied output head) are stored once;
    `aliases` maps the later names to the stored one. Block-quantized weights are uint8 blocks.
    """
    formats = param_formats(graph, dtype)
    stored: dict[tuple, str] = {}
    entries, aliases = [], {}
    for full, p, layer in graph.all_params():
        source = (tuple(p.sources(layer)), p.shape, formats[full], p.offset)
        if source in stored:
            aliases[full] = stored[source]
            continue
        stored[source] = full
        quantized = FORMATS[formats[full]].quantized
        entries.append((full, stored_shape(p.shape, formats[full]), torch.uint8 if quantized else torch_dtype(dtype)))
    return entries, aliases


def quantized_names(graph: Graph, dtype: str) -> dict[str, str]:
    """{stored name: format} of the block-quantized weights in the prepared-weights file."""
    entries, _ = layout(graph, dtype)
    formats = param_formats(graph, dtype)
    return {name: formats[name] for name, _, _ in entries if FORMATS[formats[name]].quantized}


def produce(graph: Graph, ckpt: Checkpoint, dtype: str) -> Iterator[torch.Tensor]:
    """The prepared weights in `layout` order, one at a time (each source released once written)."""
    _, aliases = layout(graph, dtype)
    formats = param_formats(graph, dtype)
    for full, p, layer in graph.all_params():
        if full not in aliases:
            if FORMATS[formats[full]].quantized:
                yield stored_blocks(p, layer, ckpt, formats[full])
            else:
                yield materialize(p, layer, ckpt, torch_dtype(dtype))
            release_sources(p, layer, ckpt)


def stored_blocks(p: Param, layer: int | None, ckpt: Checkpoint, fmt: str) -> torch.Tensor:
    """`p` as `fmt` blocks: the source's own bytes where every part is stored so (a GGUF of that
    format), else quantized from float32 as llama.cpp's quantizer takes them."""
    own = [ckpt.blocks(s, fmt) for s in p.sources(layer)]
    if all(b is not None for b in own):
        return own[0] if len(own) == 1 else torch.cat(own, dim=0)
    return quantize(materialize(p, layer, ckpt, torch.float32), fmt)


def release_sources(p: Param, layer: int | None, ckpt: Checkpoint) -> None:
    """Drop the checkpoint pages a param was made from: a compile or export streams the model
    through memory instead of ending with all of it resident."""
    for s in p.sources(layer):
        ckpt.release(s)


def gathered_weights(graph: Graph) -> list[str]:
    """Names of the global params read by `embedding` ops (rows gathered, never read whole)."""
    return sorted({n.inputs[1] for n in graph.prologue if n.op == "embedding" and n.inputs[1] in graph.params})


def linear_weights(graph: Graph) -> dict[str, list[str]]:
    """Names of the weight matrices ops multiply as a linear does (global, and per-layer local names):
    linear weights, experts' stacks."""
    def feeding(nodes, params) -> list[str]:
        return sorted({name for n in nodes for i in OPS[n.op].matrices if (name := n.inputs[i]) in params})

    return {"global": feeding(graph.prologue + graph.epilogue, graph.params),
            "block": feeding(graph.block.nodes, graph.block.params),
            "experts": expert_stacks(graph)}


def read_shares(graph: Graph, batch: int = 1) -> dict[str, float]:
    """Each param's (full name) share that a decode step of `batch` rows reads: all of it, or of an
    expert stack the experts the rows choose (top_k of E for one row; for several, the share a uniform
    router reaches, 1 - (1 - k/E)^batch): a mixture of experts' active parameters."""
    stacks = _expert_matrices(graph)
    shares = {}
    for full, _, layer in graph.all_params():
        count, k = stacks.get(full.split(".", 2)[2], (1, 1)) if layer is not None else (1, 1)
        shares[full] = 1 - (1 - k / count) ** batch
    return shares


def expert_stacks(graph: Graph) -> dict[str, int]:
    """{local name: experts} of the block's stacked expert matrices (a runtime packs each expert's own)."""
    return {name: count for name, (count, _) in _expert_matrices(graph).items()}


def _expert_matrices(graph: Graph) -> dict[str, tuple[int, int]]:
    """{local name: (experts, top_k)} of each matrix an `experts` op stacks."""
    return {n.inputs[i]: (graph.values[n.inputs[1]].shape[-1], n.attrs["top_k"]) for n in graph.block.nodes
            if n.op == "experts" for i in OPS[n.op].matrices}
