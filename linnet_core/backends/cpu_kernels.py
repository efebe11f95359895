"""CPU kernels behind a session's weights: oneDNN pre-packed linear weights, Linnet's own decode
kernels (bf16 GEMV, attention) and its block-quantized linears and token tables.

Decode is a chain of matrix-vector products bound by memory bandwidth. On this machine class
F.linear (MKL) streams float32 weights at ~21 GB/s, while oneDNN's kernel over weights reordered
once at load reaches ~45 GB/s, and is faster for prefill GEMMs and bfloat16 too (measured with
`LINNET_CPU_PACK=0 linnet bench ... --backend torch` against the default). Inductor's CPU freezing pass uses the same ops. Packing is probed once
and skipped, never fatal, where this PyTorch build or CPU lacks it; LINNET_CPU_PACK=0 turns it off.
"""

from __future__ import annotations

import functools
import os
import threading
from contextlib import contextmanager
from typing import Optional

import torch
import torch.nn.functional as F

from ..dtypes import FORMATS
from ..quant import BLOCK, dequantize
from . import decode_kernels


@functools.lru_cache(maxsize=None)
def packing_works(dtype: torch.dtype) -> bool:
    """Whether packed weights of `dtype` run here and agree with F.linear."""
    if os.environ.get("LINNET_CPU_PACK", "1") == "0" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False
    if dtype not in (torch.float32, torch.bfloat16):
        return False
    try:
        g = torch.Generator().manual_seed(0)
        w = torch.randn(48, 32, generator=g).to(dtype)
        x = torch.randn(2, 3, 32, generator=g).to(dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 1)
        got = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        return bool(torch.allclose(got.float(), F.linear(x, w).float(), atol=1e-2, rtol=1e-2))
    except (RuntimeError, AttributeError):
        return False


def pack(weight: torch.Tensor) -> torch.Tensor:
    """The weight reordered for oneDNN (an opaque mkldnn tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, 1)


_active = threading.local()  # the kernels of the session whose compiled step runs in this thread


@contextmanager
def active(kernels: list["PackedLinear"]):
    """Make `kernels` the ones `packed_linear` handles refer to, while a compiled step runs."""
    previous = getattr(_active, "kernels", None)
    _active.kernels = kernels
    try:
        yield
    finally:
        _active.kernels = previous


@torch.library.custom_op("linnet::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, handle: int, out_features: int, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x @ W.T (+ bias) through the CPU kernel number `handle` of the running session (oneDNN's
    packed weights, or Linnet's bf16 GEMV).

    A custom op, so torch.compile sees one opaque call (shape from the fake below) and keeps the
    kernel, where its own freezing pass would pick MKL's slower packed GEMM for float32.
    Handles are positions in the session's weights, the same in every process, so compiled code
    cached on disk stays valid.
    """
    return _active.kernels[handle].eager(x, bias)


@packed_linear.register_fake
def _(x, handle, out_features, bias=None):
    return x.new_empty((*x.shape[:-1], out_features))


class CpuLinear:
    """A linear weight with a CPU kernel of its own; the generated `linear` calls it instead of F.linear."""

    def __init__(self, weight: torch.Tensor, handle: int):
        self.out_features = weight.shape[0]
        self.handle = handle

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if torch.compiler.is_compiling():  # traced: one opaque op for the compiler
            return torch.ops.linnet.packed_linear(x, self.handle, self.out_features, bias)
        return self.eager(x, bias)  # eager: no dispatch detour

    def eager(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError


class PackedLinear(CpuLinear):
    """The weight reordered once for oneDNN (a copy, the mapped original released)."""

    def __init__(self, weight: torch.Tensor, handle: int):
        super().__init__(weight, handle)
        self.packed = pack(weight)

    def eager(self, x, bias):
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")


class DecodeLinear(CpuLinear):
    """A bfloat16 weight kept as mapped (no copy): Linnet's own kernel for decode's one or two rows,
    F.linear for prefill."""

    def __init__(self, weight: torch.Tensor, handle: int):
        super().__init__(weight, handle)
        self.weight = weight

    def eager(self, x, bias):
        return decode_kernels.decode_linear(x, self.weight, bias)


class QuantLinear(CpuLinear):
    """A weight held as GGUF blocks (q8_0, q4_0), repacked once for Linnet's int8 kernel (the same
    bytes, 8 rows interleaved: a copy, the mapped original released); never a float copy."""

    def __init__(self, blocks: torch.Tensor, handle: int, fmt: str):
        self.out_features, self.handle = blocks.shape[0], handle
        self.packed, self.fmt = decode_kernels.repack(blocks, fmt), fmt

    def eager(self, x, bias):
        return decode_kernels.quant_linear(x, self.packed, self.fmt, self.out_features, bias)


@torch.library.custom_op("linnet::quant_rows", mutates_args=())
def quant_rows(ids: torch.Tensor, handle: int, width: int) -> torch.Tensor:
    """Rows `ids` of the running session's quantized table number `handle`, dequantized (float32)."""
    return _active.kernels[handle].eager(ids)


@quant_rows.register_fake
def _(ids, handle, width):
    return ids.new_empty((*ids.shape, width), dtype=torch.float32)


class QuantTable:
    """A token table held as GGUF blocks: the step's `embedding` dequantizes only the rows it gathers."""

    def __init__(self, blocks: torch.Tensor, handle: int, fmt: str):
        self.blocks, self.handle, self.fmt = blocks, handle, fmt
        self.width = blocks.shape[1] // FORMATS[fmt].block_bytes * BLOCK

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [...] -> float32 rows [..., width]."""
        if torch.compiler.is_compiling():
            return torch.ops.linnet.quant_rows(ids, self.handle, self.width)
        return self.eager(ids)

    def eager(self, ids: torch.Tensor) -> torch.Tensor:
        return dequantize(self.blocks[ids], self.fmt)


def linear_kernel(dtype: torch.dtype) -> type[CpuLinear] | None:
    """The kernel class for linear weights of `dtype` on this CPU: Linnet's own bf16 GEMV where
    it builds and runs, else oneDNN's packed weights where they run, else none (F.linear)."""
    if dtype == torch.bfloat16 and decode_kernels.extension() is not None:
        return DecodeLinear
    return PackedLinear if packing_works(dtype) else None


def pack_linear_weights(weights: dict, names: dict[str, list[str]], pack: bool = True) -> list:
    """Replace, in place, the weights that feed linear ops by CPU kernels (and a quantized token
    table by its row gather); returns them in handle order. Float weights get a kernel only where
    one runs here and `pack`; block-quantized ones always (Linnet's kernels are their only way)."""
    sample = next(t for t in weights["global"].values() if isinstance(t, torch.Tensor) and t.is_floating_point())
    kind = linear_kernel(sample.dtype) if sample.device.type == "cpu" and pack else None
    kernels: list = []
    format_of = getattr(weights, "format_of", lambda name: None)
    release = getattr(weights, "release", lambda name: None)  # the mapped original, once packed (a copy)
    groups = [(weights["global"], names["global"], "")]
    groups += [(layer, names["block"], f"blk.{i}.") for i, layer in enumerate(weights["layers"])]
    for group, linear_names, prefix in groups:
        for name in group:
            fmt = format_of(prefix + name)
            if fmt is not None:
                wrap = QuantLinear if name in linear_names else QuantTable
                group[name] = wrap(group[name], len(kernels), fmt)
                if wrap is QuantLinear:
                    release(prefix + name)
            elif name in linear_names and kind is not None:
                group[name] = kind(group[name], len(kernels))
                if kind is PackedLinear:
                    release(prefix + name)
            else:
                continue
            kernels.append(group[name])
    return kernels


@torch.library.custom_op("linnet::decode_attention", mutates_args=())
def decode_attention_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, layer: int, slots: torch.Tensor,
                        pos: torch.Tensor, window: int, scale: float) -> torch.Tensor:
    """Linnet's decode attention as one opaque op for torch.compile (shape from the fake below)."""
    return decode_kernels.extension().decode_attention(q.contiguous(), k_cache, v_cache, layer, slots, pos, window, scale)


@decode_attention_op.register_fake
def _(q, k_cache, v_cache, layer, slots, pos, window, scale):
    return torch.empty_like(q)


class DecodeAttention:
    """Attention of one-token queries straight over the KV cache (decode_kernels), handed to the
    generated step as weights["global"]["decode_attention"]; its `attend` calls it for decode."""

    def __init__(self, ext):
        self.ext = ext

    def __call__(self, q, pos, slots, k_cache, v_cache, layer: int, window: int | None, scale: float):
        """q [B, H, D] at positions pos [B] of cache rows slots [B] -> [B, H, D]."""
        if torch.compiler.is_compiling():
            return torch.ops.linnet.decode_attention(q, k_cache, v_cache, layer, slots, pos, window or 0, scale)
        return self.ext.decode_attention(q.contiguous(), k_cache, v_cache, layer, slots, pos, window or 0, scale)


def add_decode_attention(weights: dict, dtype: torch.dtype, head_dim: int) -> bool:
    """Hand a CPU step the decode attention kernel where it runs for these caches; whether it does."""
    ext = decode_kernels.extension()
    if ext is None or not decode_kernels.attention_fits(dtype, head_dim):
        return False
    weights["global"]["decode_attention"] = DecodeAttention(ext)
    return True
