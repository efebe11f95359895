"""linnet verify: distance from the reference (transformers, eager) with a pass/fail to gate on."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from linnet_core.check.quant_effect import QuantEffect

from ..options import (
    BackendName,
    BackendOpt,
    CacheLenOpt,
    DtypeOpt,
    JsonOpt,
    ModelArg,
    QuietOpt,
    RevisionOpt,
)
from ..output import EXIT_CHECK_FAILED, Sink, handle_errors


@handle_errors
def verify_command(
    model: ModelArg,
    backend: BackendOpt = BackendName.torch,
    dtype: DtypeOpt = "float32",
    steps: Annotated[int, typer.Option(min=1, help="Teacher-forced decode steps after the prefill.")] = 8,
    prompt: Annotated[Optional[str], typer.Option("--prompt", "-p", help="Prompt text (default: a fixed one).")] = None,
    cache_len: CacheLenOpt = None,
    revision: RevisionOpt = None,
    json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Compare a backend with transformers (eager) on the same tokens (a .gguf file: with llama.cpp on
    the file); exit 3 past the tolerance."""
    # The core (and torch) load here, not at CLI start-up, so --help and completion stay fast.
    from linnet_core.check.verify import verify  # imports torch: not at start-up

    sink = Sink(json, quiet)
    gguf = str(model or "").lower().endswith(".gguf")  # a GGUF's reference is llama.cpp on the file
    sink.info(f"verifying {model} on {backend.value} ({dtype}) against "
              f"{'llama.cpp on the file' if gguf else 'transformers eager'}...")
    r = verify(model, backend.value, dtype, steps, prompt, cache_len, revision=revision)
    verdict = "[bold green]PASS[/]" if r.passed else "[bold red]FAIL[/]"
    sink.data(
        f"{verdict} {r.backend} {r.dtype}: distance from reference {r.distance:.3g} "
        f"(tolerance {r.tolerance:.3g}) · top-1 agreement {r.top1_agreement:.1%} · "
        f"greedy tokens {'identical' if r.tokens_match else 'differ'} · "
        f"{r.prompt_tokens} prompt tokens + {r.steps} steps"
        + (f" · reference: {r.reference_dtype}" if r.reference_dtype.startswith("llama.cpp") else
           f" · reference in {r.reference_dtype} (float32 does not fit here)" if r.reference_dtype != "float32" else "")
        + (f" · activations quantized to {r.activations} by the kernels" if r.activations == "int8" else "")
        + (f"\n  quantization's own effect, {QuantEffect(**r.quantization).describe()}" if r.quantization else ""),
        r.to_json(),
    )
    if not r.passed:
        raise typer.Exit(EXIT_CHECK_FAILED)
