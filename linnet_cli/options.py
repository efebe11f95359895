"""Shared option types; choices come from the core's registries, never from copies here."""

from __future__ import annotations

from enum import Enum
from typing import Annotated, Optional

import typer

from linnet_core.backends import BACKEND_NAMES
from linnet_core.dtypes import FORMAT_ALIASES, FORMATS, normalize_format
from linnet_core.models.catalog import SHORT_NAMES

BackendName = Enum("BackendName", {name: name for name in BACKEND_NAMES}, type=str)


def _dtype(value: str) -> str:
    """Accept every spelling (bf16, fp16, float32, q4, ...), pass on the canonical name."""
    canonical = "auto" if value == "auto" else normalize_format(value)
    if canonical is None:
        raise typer.BadParameter(f"'{value}' is not one of auto, {', '.join(FORMAT_ALIASES)}")
    return canonical


def _complete_dtype(incomplete: str) -> list[str]:
    return [d for d in ("auto", *FORMATS) if d.startswith(incomplete)]


def _complete_model(incomplete: str) -> list[str]:
    return [n for n in SHORT_NAMES if n.startswith(incomplete)]


ModelArg = Annotated[
    str, typer.Argument(help="Checkpoint folder, .gguf file, Hugging Face repo id, or short name (see README).",
                        autocompletion=_complete_model, show_default=False)
]
OptionalModelArg = Annotated[
    Optional[str], typer.Argument(
        help="Checkpoint folder, .gguf file, repo id or short name; default: the embedded model.",
        autocompletion=_complete_model, show_default=False)
]
BackendOpt = Annotated[BackendName, typer.Option("--backend", "-b", help="Backend to compile for.")]
DtypeOpt = Annotated[str, typer.Option(
    "--dtype", "-d", callback=_dtype, autocompletion=_complete_dtype, metavar="[auto|float32|float16|bfloat16|q8_0|q4_0]",
    help="Compute dtype (bf16, fp16, f32 also accepted), or weights in llama.cpp's q8_0 / q4_0 blocks "
         "(computed in float32); auto = the checkpoint's.")]
CacheLenOpt = Annotated[
    Optional[int], typer.Option("--cache-len", min=1, help="KV cache positions (default: min(2048, model max)).")
]
RevisionOpt = Annotated[Optional[str], typer.Option("--revision", help="Hugging Face revision (branch, tag, commit).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print the result as JSON on stdout.")]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="Print nothing but errors (and the data).")]
