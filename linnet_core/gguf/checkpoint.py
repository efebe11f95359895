"""A GGUF file as a model source: its tensors under the names a Hugging Face checkpoint has.

`GgufCheckpoint` is a Checkpoint over one GGUF: the family's weight map names each tensor, so the
graph, weight preparation and every backend read it as they read safetensors. F32, F16 and BF16
tensors are views of the mapped file; Q8_0 and Q4_0 keep their blocks for a compile in that format
(the bytes unchanged) and are dequantized for any other; K-quants are dequantized (the `gguf`
package's decoders). Rows llama.cpp permuted for its adjacent-pair rope are put back. The file is
parsed by the defensive reader, whose bounds cover every tensor.
"""

from __future__ import annotations

import mmap
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..dtypes import FORMATS
from ..errors import BackendUnavailable, CheckpointError, UnsupportedModel
from ..quant import dequantize
from ..weights import Checkpoint, TensorInfo
from .config import config_from_gguf, gguf_tensor_names
from .reader import GGUFFile

# GGUF types read as they are, as torch dtypes; the block formats Linnet computes on, by GGUF name.
FLOAT_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
BLOCK_FORMATS = {f.gguf.upper(): name for name, f in FORMATS.items() if f.quantized}
# Every GGUF type Linnet computes on as it is stored, by the --dtype that keeps it.
KEPT = {f.gguf.upper(): name for name, f in FORMATS.items()}
# Dequantized by the `gguf` package: the K-quants, and the legacy blocks llama.cpp's quantizer falls
# back to where a row is shorter than a K-quant's 256 (a small model's expert matrices).
DEQUANTIZED_TYPES = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q4_1", "Q5_0", "Q5_1")


def is_gguf(path: Path) -> bool:
    return path.is_file() and path.suffix.lower() == ".gguf"


def read_gguf_config(path: Path) -> tuple[dict[str, Any], GGUFFile]:
    """The config.json the GGUF at `path` describes (with its weights' storage as `dtype`), and the parsed file."""
    g = GGUFFile(path)
    try:
        cfg = config_from_gguf(g)
        cfg["dtype"] = storage_format(g)
        cfg["gguf_weights"] = weight_type(g)
    except Exception:
        g.close()
        raise
    return cfg, g


def weight_type(g: GGUFFile) -> str:
    """The GGUF type most of the file's matrices are stored in ("Q4_K" for a Q4_K_M)."""
    types = [t.type for n, t in g.tensors.items() if len(t.shape) == 2 and n != "token_embd.weight"]
    return max(set(types), key=types.count) if types else "F32"


def storage_format(g: GGUFFile) -> str:
    """The format `--dtype auto` means for this file: its matrices' own where Linnet computes on it
    (f32, f16, bf16, q8_0, q4_0), bfloat16 for K-quants and the rest (dequantized)."""
    return KEPT.get(weight_type(g), "bfloat16")


def _unpermute(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's adjacent-pair rows [heads * head_dim, ...] back to rotate-half order, per head
    (the inverse of export's permute_for_interleaved_rope; block rows move whole)."""
    return rows.reshape(heads, rows.shape[0] // heads // 2, 2, *rows.shape[1:]).transpose(1, 2).reshape(rows.shape)


class GgufCheckpoint(Checkpoint):
    """One GGUF's tensors under the family's Hugging Face names (see the module docstring)."""

    def __init__(self, path: Path, spec):
        self.files = [Path(path)]
        self.metadata: dict[str, str] = {}
        self.tensors: dict[str, TensorInfo] = {}
        self._maps: dict[Path, mmap.mmap] = {}
        self._source: dict[str, tuple[str, int | None]] = {}  # hf name -> (GGUF type, permuted heads)
        # llama.cpp stores Gemma's norms as 1 + weight, the value they scale by: the checkpoint's is the weight
        self._shift: dict[str, float] = {}
        with GGUFFile(path) as g:
            for hf, (name, heads, expert) in gguf_tensor_names(spec).items():
                t = g.tensors.get(name)
                if t is None:
                    continue  # Checkpoint.info names it as missing when the graph asks for it
                if t.type not in FLOAT_TYPES and t.type not in BLOCK_FORMATS and t.type not in DEQUANTIZED_TYPES:
                    raise UnsupportedModel(f"{path}: tensor '{name}' is {t.type}, which Linnet does not read "
                                           f"(reads: {', '.join([*FLOAT_TYPES, *BLOCK_FORMATS, *DEQUANTIZED_TYPES])})")
                dtype = FLOAT_TYPES.get(t.type, torch.uint8)
                if expert is None:
                    self.tensors[hf] = TensorInfo(name, Path(path), dtype, t.shape, t.offset, t.nbytes)
                elif len(t.shape) != 3 or t.shape[0] != spec.num_experts:
                    raise CheckpointError(f"{path}: tensor '{name}' has shape {list(t.shape)}, the metadata implies "
                                          f"{spec.num_experts} experts stacked [experts, rows, columns]")
                else:  # expert e's matrix: a contiguous slice of the stack, every row whole
                    each = t.nbytes // t.shape[0]
                    self.tensors[hf] = TensorInfo(name, Path(path), dtype, t.shape[1:], t.offset + expert * each, each)
                self._source[hf] = (t.type, heads)
                if spec.norm_weight_offset and name.endswith("norm.weight"):
                    self._shift[hf] = spec.norm_weight_offset

    def _raw(self, info: TensorInfo) -> torch.Tensor:
        return torch.frombuffer(self._mapped(info.file), dtype=torch.uint8, count=info.nbytes, offset=info.start)

    def get(self, name: str) -> torch.Tensor:
        info = self.info(name)
        gtype, heads = self._source[name]
        if gtype in FLOAT_TYPES:
            w = super().get(name)
        elif gtype in BLOCK_FORMATS:
            w = dequantize(self._raw(info).view(info.shape[0], -1), BLOCK_FORMATS[gtype])
        else:
            w = torch.from_numpy(_dequantize_k(self._raw(info).numpy(), gtype, info.shape))
        if name in self._shift:
            w = w.float() - self._shift[name]
        return _unpermute(w, heads) if heads else w

    def blocks(self, name: str, fmt: str) -> torch.Tensor | None:
        """`name`'s own blocks when the file stores it in `fmt` ([rows, bytes]: the bytes unchanged)."""
        info = self.info(name)
        gtype, heads = self._source[name]
        if BLOCK_FORMATS.get(gtype) != fmt:
            return None
        rows = self._raw(info).view(info.shape[0], -1)
        return _unpermute(rows, heads) if heads else rows


def _dequantize_k(raw: np.ndarray, gtype: str, shape: tuple[int, ...]) -> np.ndarray:
    try:
        import gguf
    except ImportError:
        raise BackendUnavailable(f"reading {gtype} tensors needs the gguf package",
                                 hint="pip install 'linnet[gguf]'") from None
    try:
        return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[gtype]).reshape(shape).astype(np.float32)
    except (ValueError, NotImplementedError) as e:
        raise CheckpointError(f"{gtype} tensor of shape {list(shape)} cannot be decoded: {e}") from None
