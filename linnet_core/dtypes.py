"""Compute dtypes and the spellings people and configs use for them: one table for all."""

from __future__ import annotations

DTYPES = ("float32", "float16", "bfloat16")
ALIASES = {
    "float32": "float32", "fp32": "float32", "f32": "float32", "float": "float32",
    "float16": "float16", "fp16": "float16", "f16": "float16", "half": "float16",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
}


def normalize_dtype(name: str) -> str | None:
    """The canonical dtype for a spelling (`bf16`, `torch.float16`, ...), or None if unknown."""
    return ALIASES.get(str(name).lower().removeprefix("torch."))
