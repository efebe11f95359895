"""CPU kernels behind a session's linear weights: oneDNN pre-packed weights, Linnet's own 16-bit
GEMV and float16 weights repacked for it, its block-quantized linears and token tables.

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
import weakref
from contextlib import contextmanager
from typing import Optional

import torch
import torch.nn.functional as F

from ...dtypes import FORMATS
from ...quant import BLOCK
from . import extension
from .build import QUANT_CODES, cpu_features


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


_NO_TENSOR = torch.empty(0)
_active = threading.local()  # the kernels of the session whose compiled step runs in this thread

# csrc/ops.cpp's kinds
NATIVE_NONE, NATIVE_BF16, NATIVE_BLOCKS, NATIVE_TABLE, NATIVE_ROW, NATIVE_PACKED = 0, 1, 2, 3, 4, 5


class Kernels(list):
    """A session's CPU kernels in handle order. Those of Linnet's own (bf16 GEMV, blocks) are also
    registered once with the C++ operators (csrc/ops.cpp) that compiled steps call."""

    def __init__(self, kernels: list):
        super().__init__(kernels)
        self.native_id = 0  # the C++ side's id of this session's kernels; 0: none registered
        natives = [k.native() for k in kernels]
        if not any(kind != NATIVE_NONE for kind, _, _ in natives):
            return  # nothing to register (a GPU session has no CPU kernels): the extension is not built for it
        ext = extension.extension()
        if ext is not None:
            self.native_id = ext.register_kernels(natives)
            weakref.finalize(self, ext.release_kernels, self.native_id)


@contextmanager
def active(kernels: Kernels):
    """Make `kernels` the ones handles refer to (Python's ops and the C++ ones), while a compiled step runs."""
    previous = getattr(_active, "kernels", None)
    _active.kernels = kernels
    ext = extension.extension() if kernels.native_id else None
    native_before = ext.activate(kernels.native_id) if ext is not None else None
    try:
        yield
    finally:
        _active.kernels = previous
        if ext is not None:
            ext.activate(native_before)


@torch.library.custom_op("linnet::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, handle: int, out_features: int, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x @ W.T (+ bias) through the CPU kernel number `handle` of the running session: oneDNN's
    packed weights (Linnet's own kernels are C++ operators, csrc/ops.cpp, called in ~5 us where
    this Python op costs ~25 inside a compiled step).

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
        if torch.compiler.is_compiling():  # traced: one opaque op for the compiler, C++ where it can be
            if self.native_kind != NATIVE_NONE:
                return torch.ops.linnet_kernels.linear(x, self.handle, self.out_features, bias)
            return torch.ops.linnet.packed_linear(x, self.handle, self.out_features, bias)
        return self.eager(x, bias)  # eager: no dispatch detour

    def eager(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    native_kind = NATIVE_NONE  # csrc/ops.cpp's kind; NATIVE_NONE: a Python-side kernel

    def native(self) -> tuple[int, torch.Tensor, int]:
        """(kind, weight, format code) for csrc/ops.cpp."""
        return NATIVE_NONE, _NO_TENSOR, 0


class PackedLinear(CpuLinear):
    """The weight reordered once for oneDNN (a copy, the mapped original released)."""

    def __init__(self, weight: torch.Tensor, handle: int):
        super().__init__(weight, handle)
        self.packed = pack(weight)

    def eager(self, x, bias):
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")


class DecodeLinear(CpuLinear):
    """A bfloat16 weight kept as mapped (no copy): Linnet's own kernel for decode's few rows,
    F.linear for prefill (oneDNN's GEMM, on AMX where the CPU has it)."""

    def __init__(self, weight: torch.Tensor, handle: int):
        super().__init__(weight, handle)
        self.weight = weight

    def eager(self, x, bias):
        return extension.decode_linear(x, self.weight, bias)

    native_kind = NATIVE_BF16

    def native(self):
        return self.native_kind, self.weight, 0


class RowLinear(DecodeLinear):
    """A 16-bit or float32 weight kept as mapped (no copy; a head tied to the token table): Linnet's
    GEMV for decode, and for 16-bit prompts its tiled GEMM (bf16's where the ISA has no bf16 dot),
    both widening the weights in registers (PyTorch's CPU float16 GEMM ran ~7x slower at Qwen3-4B's
    shapes)."""

    native_kind = NATIVE_ROW

    def eager(self, x, bias):
        y = extension.extension().row_linear(x, self.weight)
        return y if bias is None else y + bias


class PackedFloatLinear(CpuLinear):
    """A float16, float32 or bfloat16 weight repacked once in blocks of 4 rows interleaved (a copy in
    2 MiB pages, the mapped original released): decode loads each 16 of x once for a block's rows, a GEMV
    16% faster than the row-at-a-time one for float16 at Qwen3-4B's shapes (for bfloat16 by the pair
    dot product, as fast for one row and 1.2x for five); a prompt's register tile reads one block as
    one stream."""

    def __init__(self, weight: torch.Tensor, handle: int):
        super().__init__(weight, handle)
        self.packed = extension.extension().repack_rows8_float(weight)

    def eager(self, x, bias):
        y = extension.extension().packed_float_linear(x, self.packed, self.out_features)
        return y if bias is None else y + bias

    native_kind = NATIVE_PACKED

    def native(self):
        return self.native_kind, self.packed, 0


class QuantLinear(CpuLinear):
    """A weight held as GGUF blocks (q8_0, q4_0), repacked once for Linnet's int8 kernel (the same
    blocks, 8 rows interleaved: a copy, the mapped original released); never a float copy."""

    def __init__(self, blocks: torch.Tensor, handle: int, fmt: str):
        self.out_features, self.handle = blocks.shape[0], handle
        self.packed, self.fmt = extension.repack(blocks, fmt), fmt

    def eager(self, x, bias):
        return extension.quant_linear(x, self.packed, self.fmt, self.out_features, bias)

    native_kind = NATIVE_BLOCKS

    def native(self):
        return self.native_kind, self.packed, QUANT_CODES[self.fmt]


class QuantTable:
    """A token table held as GGUF blocks: the step's `embedding` dequantizes only the rows it gathers."""

    def __init__(self, blocks: torch.Tensor, handle: int, fmt: str):
        self.blocks, self.handle, self.fmt = blocks, handle, fmt
        self.width = blocks.shape[1] // FORMATS[fmt].block_bytes * BLOCK

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [...] -> float32 rows [..., width] (exactly quant.dequantize's)."""
        if torch.compiler.is_compiling():  # csrc/ops.cpp's operator
            return torch.ops.linnet_kernels.embedding(ids, self.handle, self.width)
        return extension.extension().dequant_rows(self.blocks, ids, QUANT_CODES[self.fmt])

    def native(self):
        return NATIVE_TABLE, self.blocks, QUANT_CODES[self.fmt]


class ExpertStack(list):
    """One layer's stacked expert matrix as one kernel per expert, their handles consecutive: a step
    runs the chosen experts' alone."""

    ACTIVATIONS = {"silu": 0, "gelu": 1, "gelu_tanh": 2}  # csrc/ops.cpp's codes

    def experts(self, x: torch.Tensor, weights: torch.Tensor, up: "ExpertStack", down: "ExpertStack",
                act: str) -> torch.Tensor | None:
        """The whole experts op in one C++ call (csrc/ops.cpp's `experts`, this stack the gate), or None
        where a kernel is not one of its own (oneDNN's)."""
        if any(k.native_kind == NATIVE_NONE for stack in (self, up, down) for k in stack):
            return None
        return torch.ops.linnet_kernels.experts(x, weights, self[0].handle, up[0].handle, down[0].handle,
                                                self[0].out_features, self.ACTIVATIONS[act])


def linear_kernel(dtype: torch.dtype) -> type[CpuLinear] | None:
    """The kernel class for linear weights of `dtype` on this CPU: Linnet's own (float16, float32 and
    bf16 weights repacked for its GEMVs and tiles, AMX's for bf16 prompts where the level has it; bf16
    mapped as is for its row GEMV and oneDNN's GEMM where the CPU has AMX the build lacks, or a bf16 dot
    that spans one row only) where they build and run, else
    oneDNN's packed weights where they run, else none (F.linear)."""
    ext = extension.extension()
    if ext is not None:
        # the packed pair-dot tiles run prompts at 0.90-0.94x oneDNN's AVX-512 bf16 GEMM (Zen 5) for faster
        # multi-row passes; where the CPU has AMX and this build does not (a forced lower level) oneDNN
        # runs prompts on it, 4.5x the pair-dot tiles, so there bf16 stays mapped
        amx_unused = "amx_bf16" in cpu_features() and not ext.amx()
        if dtype == torch.bfloat16 and ext.bf16_dot() and (not ext.packed_bf16_dot() or amx_unused):
            return DecodeLinear
        if dtype in (torch.float16, torch.float32, torch.bfloat16):  # bf16 widened, as float16
            return PackedFloatLinear
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
    stacks = names.get("experts", {})
    for group, linear_names, prefix in groups:
        # a head tied to the token table keeps its layout: the table's gathers read the same bytes
        tables = {t.data_ptr() for n, t in group.items() if n not in linear_names and isinstance(t, torch.Tensor)}
        for name in group:
            fmt = format_of(prefix + name)
            if fmt is None and (name not in linear_names or kind is None):
                continue
            count = stacks.get(name) if prefix else None
            w = group[name]
            # an expert stack becomes one kernel per expert (a list): a step runs the chosen ones alone
            parts = [w] if count is None else list(w.chunk(count, dim=0))
            made = [_kernel(part, len(kernels) + k, fmt, kind, name in linear_names, part.data_ptr() in tables)
                    for k, part in enumerate(parts)]
            if any(isinstance(m, (QuantLinear, PackedLinear, PackedFloatLinear)) for m in made):
                release(prefix + name)  # packed copies: the mapped original can go
            group[name] = made[0] if count is None else ExpertStack(made)
            kernels.extend(made)
    return Kernels(kernels)


def _kernel(w: torch.Tensor, handle: int, fmt: str | None, kind, linear: bool, tied: bool):
    """One weight's kernel: blocks as a quantized linear (or token table), float weights as `kind`,
    or kept as mapped (RowLinear) where the packed layout cannot take them."""
    if fmt is not None:
        return (QuantLinear if linear else QuantTable)(w, handle, fmt)
    repackable = w.shape[-1] % 16 == 0 and not tied
    return (kind if repackable or kind is not PackedFloatLinear else RowLinear)(w, handle)  # as mapped: no copy
