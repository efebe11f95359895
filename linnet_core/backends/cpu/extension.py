"""The checked build of Linnet's CPU kernels, or why there is none, and the thin Python wrappers over
it (`decode_linear`, `repack`, `quant_linear`). Anything missing means the generic ops, never an error."""

from __future__ import annotations

import functools
import warnings

import torch
import torch.nn.functional as F

from .build import QUANT_CODES, KernelBuildNotice, build_extension, candidate_levels, register_fakes, unusable
from .selfcheck import self_check


@functools.lru_cache(maxsize=None)
def _loaded():
    """(the built extension, None) or (None, why not); built and checked once, and where there is none
    the first use says why, once. A LINNET_CPU_LEVEL this CPU cannot run raises BackendUnavailable (one
    line from the CLI), never a quiet fallback."""
    ext, why = _build_and_check()
    if why and not why.startswith("turned off"):
        warnings.warn(f"Linnet's CPU kernels do not run here: {why}", KernelBuildNotice, stacklevel=3)
    return ext, why


def _build_and_check():
    why = unusable()
    if why:
        return None, why
    failed = None  # (level, error) of the first build that failed
    for level in candidate_levels():
        try:
            ext = build_extension(level)
        except Exception as e:  # noqa: BLE001 - no compiler, no ninja, a failed build: the next level, else the generic ops
            last = str(e).strip().splitlines()[-1] if str(e).strip() else ""
            failed = failed or (level, f"{type(e).__name__}: {last}")
            continue
        if ext.level() != level.name:  # the flags and vec.h's choice disagree: a build for another CPU
            return None, f"the build for {level.name} compiled as {ext.level()}"
        why = self_check(ext)
        if why:
            return None, why
        if failed:
            warnings.warn(f"Linnet's CPU kernels run at {level.label} ({level.name}): the build for "
                          f"{failed[0].name} failed ({failed[1]})", KernelBuildNotice, stacklevel=4)
        register_fakes()
        return ext, None
    return None, f"they could not be built ({failed[1]})"


def extension():
    """The built extension (`gemv_bf16`, `decode_attention`), or None (and `why_not()` says why)."""
    return _loaded()[0]


def level() -> str:
    """The level of the running build ("avx2-vnni"), or "" where there is none."""
    ext = extension()
    return ext.level() if ext is not None else ""


def why_not() -> str:
    return _loaded()[1] or ""


def decode_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias); the kernel for a few bf16 token rows, F.linear for prompts."""
    ext = extension()
    if ext is None:
        return F.linear(x, weight, bias)
    y = ext.bf16_linear(x, weight)  # the same choice as the compiled steps' operator (ops.cpp)
    return y if bias is None else y + bias


def repack(blocks: torch.Tensor, fmt: str) -> torch.Tensor:
    """`fmt` blocks [N, K / 32 * block bytes] -> the same blocks as `quant_linear` reads them (8 rows
    interleaved per block, q8_0's quants stored 128 above their value; a copy)."""
    return extension().repack_rows8(blocks, QUANT_CODES[fmt])


def quant_linear(x: torch.Tensor, packed: torch.Tensor, fmt: str, out_features: int,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] (float32) @ W.T (+ bias), W [out_features, K] as `fmt` blocks from `repack`."""
    y = extension().quant_linear(x, packed, QUANT_CODES[fmt], out_features)
    return y if bias is None else y + bias
