"""Shared option types; choices come from the core's registries, never from copies here."""

from __future__ import annotations

from enum import Enum
from typing import Annotated, Optional

import typer

from linnet_core.backends import BACKEND_NAMES
from linnet_core.dtypes import FORMAT_ALIASES, FORMATS, normalize_format
from linnet_core.models.catalog import SHORT_NAMES

BackendName = Enum("BackendName", {name: name for name in BACKEND_NAMES}, type=str)


def dtype_choice(value: str) -> str:
    """Accept every spelling (bf16, fp16, float32, q4, ...), pass on the canonical name."""
    canonical = "auto" if value == "auto" else normalize_format(value)
    if canonical is None:
        raise typer.BadParameter(f"'{value}' is not one of auto, {', '.join(FORMAT_ALIASES)}")
    return canonical


def _complete_dtype(incomplete: str) -> list[str]:
    return [d for d in ("auto", *FORMATS) if d.startswith(incomplete)]


def _complete_model(incomplete: str) -> list[str]:
    return [n for n in SHORT_NAMES if n.startswith(incomplete)]


DTYPE_HELP = ("Compute dtype (bf16, fp16, f32 also accepted), or weights in llama.cpp's q8_0 / q4_0 blocks "
              "(computed in float32); auto = the checkpoint's.")
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
    "--dtype", "-d", callback=dtype_choice, autocompletion=_complete_dtype, metavar="[auto|float32|float16|bfloat16|q8_0|q4_0]",
    help=DTYPE_HELP)]
CacheLenOpt = Annotated[
    Optional[int], typer.Option("--cache-len", min=1, help="KV cache positions (default: min(2048, model max)).")
]
RevisionOpt = Annotated[Optional[str], typer.Option("--revision", help="Hugging Face revision (branch, tag, commit).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print the result as JSON on stdout.")]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="Print nothing but errors (and the data).")]

# The engine's settings, shared by `serve`, `export triton` and the serving bench (ServeConfig's defaults).
RowsOpt = Annotated[int, typer.Option("--rows", min=1, help="KV-cache rows: requests decoded together.")]
PrefillChunkOpt = Annotated[int, typer.Option(
    "--prefill-chunk", min=1, help="Prompt tokens per step, at most (taken with the decode tokens).")]
MaxWaitingOpt = Annotated[int, typer.Option("--max-waiting", min=1, help="Queued requests before 429.")]
DecodeStallOpt = Annotated[float, typer.Option(
    "--decode-stall", min=0.0, help="A step carrying prompt tokens beside decoding rows takes at most this "
    "many times a decode-only step (measured as it runs), so prompts do not stall the tokens being "
    "streamed; 0: no bound but --prefill-chunk.")]
BurstWaitOpt = Annotated[float, typer.Option(
    "--burst-wait", min=0.0, help="With no row decoding, wait while requests keep arriving until this many "
    "milliseconds pass without one (2.5 times that at most), so a burst is admitted and decoded together "
    "(a steady inter-token latency; a lone request pays it in TTFT); 0: admit each at once.")]
PrefixCachingOpt = Annotated[bool, typer.Option(
    "--prefix-caching/--no-prefix-caching", help="Reuse the cached positions of the longest prefix a "
    "prompt shares with a cache row (a system prompt, a chat's earlier turns).")]


def name_list(values: list[str] | None, every: tuple[str, ...], default: str) -> list[str]:
    """`all`, `none`, or names, each value possibly comma-separated."""
    flat = [v.strip() for value in (values or [default]) for v in value.split(",") if v.strip()]
    if flat == ["all"]:
        return list(every)
    if flat == ["none"]:
        return []
    return list(dict.fromkeys(flat))

# Speculative decoding, shared by `run`, `serve` and `bench` (linnet_core.speculation.SpeculationOptions).
SpeculateOpt = Annotated[Optional[str], typer.Option(
    "--speculate", metavar="[ngram|draft]", help="Speculative decoding: 'ngram' proposes tokens by looking the "
    "text's last words up earlier in it (prompt lookup, no second model); 'draft' by a smaller model (--draft). "
    "Greedy output is the plain run's; sampled output follows the same distribution.", show_default=False)]
DraftOpt = Annotated[Optional[str], typer.Option(
    "--draft", help="A draft model with the target's tokenizer (folder, .gguf, repo id or short name); implies "
    "--speculate draft.", autocompletion=_complete_model, show_default=False)]
DraftTokensOpt = Annotated[int, typer.Option(
    "--draft-tokens", min=1, max=16, help="Most tokens proposed per step.")]
AdaptiveDraftOpt = Annotated[bool, typer.Option(
    "--adaptive-draft/--fixed-draft", help="Propose fewer tokens while few are accepted (the count that "
    "maximises tokens per unit of work at the running acceptance rate), or always --draft-tokens.")]
DraftBackendOpt = Annotated[Optional[BackendName], typer.Option(
    "--draft-backend", help="Backend for the draft model (default: the target's).", show_default=False)]
DraftDtypeOpt = Annotated[str, typer.Option(
    "--draft-dtype", callback=dtype_choice, autocompletion=_complete_dtype,
    metavar="[auto|float32|float16|bfloat16|q8_0|q4_0]", help="The draft model's dtype (auto: its checkpoint's).")]
