"""The kernels a CPU step receives for the ops between its matmuls (StepKernels), handed to the
generated step as weights["global"]["step_kernels"] by `add_step_kernels`: plain holders of the
checked build's functions, which the build's self-check composes too (so nothing here imports it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch


class DecodeAttention:
    """Attention of one-token queries straight over the KV cache (csrc/decode_attention.cpp); the generated
    step's `attend` calls it for decode (a StepKernels field)."""

    def __init__(self, ext):
        self.ext = ext

    def __call__(self, q, pos, slots, k_cache, v_cache, layer: int, window: int | None, scale: float,
                 softcap: float | None = None):
        """q [B, H, D] at positions pos [B] of cache rows slots [B] -> [B, H, D]."""
        args = (layer, slots, pos, window or 0, scale, softcap or 0.0)
        if torch.compiler.is_compiling():  # csrc/ops.cpp's operator
            return torch.ops.linnet_kernels.decode_attention(q, k_cache, v_cache, *args)
        return self.ext.decode_attention(q.contiguous(), k_cache, v_cache, *args)


@dataclass(frozen=True)
class StepKernels:
    """Linnet's C++ kernels for the ops between a CPU step's matmuls, handed to the generated step as
    weights["global"]["step_kernels"]; its helpers call the ones that are not None."""

    decode_attention: Optional[Callable] = None  # one-token queries over the KV cache in place
    rms_norm: Optional[Callable] = None  # eager steps only: a compiled step fuses these itself
    rope: Optional[Callable] = None
    write_cache: Optional[Callable] = None
    argmax: Optional[Callable] = None  # ATen's reads 16-bit logits one at a time
    silu: Optional[Callable] = None  # ATen's 16-bit silu: 8-9 us for Qwen3-4B's 9728 values, this one ~5
    # the eager step's fused groups (torch_groups): one call where the emitted lines were 2-15
    silu_mul: Optional[Callable] = None
    add_rms_norm: Optional[Callable] = None
    attention_block: Optional[Callable] = None  # decode steps: needs decode_attention


def attention_fits(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether `decode_attention` takes caches of `dtype` with heads of `head_dim` (whole 16-lane vectors)."""
    return dtype in (torch.float32, torch.float16, torch.bfloat16) and head_dim % 16 == 0


def add_step_kernels(weights: dict, ext, dtype: torch.dtype, head_dim: int, eager: bool) -> StepKernels | None:
    """Hand a CPU step the kernels of the checked build `ext` (extension.extension()) that run for these
    caches (for an `eager` step, also its norms, rope, cache writes, activation and greedy pick: one call
    each where the emitted ops are 3-8, or slow); the kernels, or None."""
    if ext is None:
        return None
    attention = DecodeAttention(ext) if attention_fits(dtype, head_dim) else None
    small = dict(rms_norm=ext.rms_norm, rope=ext.rope, write_cache=ext.write_cache, argmax=ext.argmax,
                 silu=ext.silu, silu_mul=ext.silu_mul, add_rms_norm=ext.add_rms_norm) if eager else {}
    if eager and attention is not None:
        small["attention_block"] = ext.attention_block
    if attention is None and not small:
        return None
    kernels = StepKernels(decode_attention=attention, **small)
    weights["global"]["step_kernels"] = kernels
    return kernels
