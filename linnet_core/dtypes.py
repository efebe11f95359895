"""Every number format Linnet knows, in one table: the spellings people and configs use, and what
each toolchain calls it.

A *compute dtype* is what activations and the KV cache are held in (float32, float16,
bfloat16). A *storage format* is how a weight lies in an artifact or an export: any compute
dtype, or a block-quantized format with GGUF's exact layout (q8_0, q4_0: 32 weights per block
with an f16 scale), which backends dequantize or compute on directly. Nothing here imports a
toolchain: the CLI reads this table to offer choices without loading torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Format:
    name: str  # canonical: "float32", "q8_0"
    aliases: tuple[str, ...]  # other spellings accepted from people and configs
    gguf: str  # llama.cpp's type name (GGMLQuantizationType member, lower case)
    block: int = 1  # weights per block
    block_bytes: int = 4  # bytes per block
    compute: bool = True  # activations and the KV cache can be held in it
    torch: str | None = None  # attribute of the torch module
    numpy: str | None = None  # numpy (or ml_dtypes) type name
    onnx: int | None = None  # onnx.TensorProto enum value
    hlo: str | None = None  # StableHLO element type

    @property
    def quantized(self) -> bool:
        return self.block > 1

    def nbytes(self, elements: int) -> int:
        """Bytes of `elements` weights in this format (a whole number of blocks)."""
        return elements // self.block * self.block_bytes


FORMATS: dict[str, Format] = {f.name: f for f in (
    Format("float32", ("fp32", "f32", "float"), "f32", 1, 4, True, "float32", "float32", 1, "f32"),
    Format("float16", ("fp16", "f16", "half"), "f16", 1, 2, True, "float16", "float16", 10, "f16"),
    Format("bfloat16", ("bf16",), "bf16", 1, 2, True, "bfloat16", "bfloat16", 16, "bf16"),
    # GGUF's block layouts: an f16 scale, then 32 int8 weights / 32 4-bit weights offset by 8.
    Format("q8_0", ("q8",), "q8_0", 32, 34, False),
    Format("q4_0", ("q4",), "q4_0", 32, 18, False),
)}
DTYPES: tuple[str, ...] = tuple(n for n, f in FORMATS.items() if f.compute)
QUANTIZED: tuple[str, ...] = tuple(n for n, f in FORMATS.items() if f.quantized)
ALIASES: dict[str, str] = {s: f.name for f in FORMATS.values() if f.compute for s in (f.name, *f.aliases)}
FORMAT_ALIASES: dict[str, str] = {s: f.name for f in FORMATS.values() for s in (f.name, *f.aliases)}
ONNX_INT64 = 7  # onnx.TensorProto.INT64: every index input of the emitted graphs


def normalize_dtype(name: str) -> str | None:
    """The canonical compute dtype for a spelling (`bf16`, `torch.float16`, ...), or None if unknown."""
    return ALIASES.get(str(name).lower().removeprefix("torch."))


def normalize_format(name: str) -> str | None:
    """The canonical storage format for a spelling (a compute dtype, or `q8_0`, `q4`, ...)."""
    return FORMAT_ALIASES.get(str(name).lower().removeprefix("torch."))


QUANT_COMPUTE = "float32"  # activations of quantized weights (and their KV cache where a backend does not narrow it)


def compute_dtype(name: str) -> str:
    """The compute dtype a storage format runs in: itself, or float32 for a block-quantized one."""
    return name if FORMATS[name].compute else QUANT_COMPUTE


# The KV cache of block-quantized weights where a backend holds it apart from the activations: half
# float32's bytes to keep and to read each step, as llama.cpp keeps its cache (its rounding is far
# below the weights' own).
QUANT_KV_CACHE = "float16"


def narrow_kv_cache_dtype(name: str) -> str:
    """The KV cache's dtype under a storage format where the backend may hold it narrower than the
    activations: float16 for a block-quantized format, else the compute dtype."""
    return QUANT_KV_CACHE if FORMATS[name].quantized else compute_dtype(name)


def torch_dtype(name: str) -> Any:
    """The torch dtype activations take under a format (a quantized one computes in float32)."""
    import torch

    return getattr(torch, FORMATS[compute_dtype(name)].torch)


def numpy_dtype(name: str) -> Any:
    """The numpy dtype of a format's activations; bfloat16 comes from ml_dtypes (numpy has none)."""
    import numpy as np

    name = compute_dtype(name)
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(FORMATS[name].numpy)


def onnx_elem_of_torch(dtype: Any) -> int:
    """The onnx.TensorProto element type of a torch dtype (compute dtypes and int64)."""
    name = str(dtype).removeprefix("torch.")
    return ONNX_INT64 if name == "int64" else FORMATS[name].onnx
