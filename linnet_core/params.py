"""Prepared weights: the graph's params made from checkpoint tensors (concatenated, cast).

Shared by every backend and export. Names and shapes are checked against the checkpoint before
any data is read, so a missing tensor or a shape that disagrees with the config is reported
with the file and tensor named, before an artifact is half-written.
"""

from __future__ import annotations

from typing import Iterator

import torch

from .errors import CheckpointError
from .ir.graph import Graph, Param
from .weights import Checkpoint

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def check_against(graph: Graph, ckpt: Checkpoint) -> None:
    """Every source tensor exists with the shape the graph needs (no data read)."""
    for full, p, layer in graph.all_params():
        rows = 0
        for src in p.sources(layer):
            info = ckpt.info(src)
            expected_cols = p.shape[1:]
            if tuple(info.shape[1:]) != tuple(expected_cols) or (len(p.parts) == 1 and tuple(info.shape) != p.shape):
                raise CheckpointError(
                    f"{info.file.name}: tensor '{src}' has shape {list(info.shape)}, the config implies "
                    f"{list(p.shape) if len(p.parts) == 1 else ['*', *expected_cols]}"
                )
            rows += info.shape[0] if info.shape else 1
        if rows != p.shape[0]:
            raise CheckpointError(f"tensors {p.sources(layer)} have {rows} rows together, the config implies {p.shape[0]}")


def materialize(p: Param, layer: int | None, ckpt: Checkpoint, dtype: torch.dtype) -> torch.Tensor:
    parts = [ckpt.get(s) for s in p.sources(layer)]
    t = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
    return t.to(dtype)


def layout(graph: Graph, dtype: str) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """(name, shape, dtype) of every prepared weight, in file order."""
    return [(full, p.shape, TORCH_DTYPES[dtype]) for full, p, _ in graph.all_params()]


def produce(graph: Graph, ckpt: Checkpoint, dtype: str) -> Iterator[torch.Tensor]:
    """The prepared weights in `layout` order, one at a time."""
    for _, p, layer in graph.all_params():
        yield materialize(p, layer, ckpt, TORCH_DTYPES[dtype])
