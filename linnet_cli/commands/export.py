"""linnet export: folders for the runtimes people already run (one subcommand per format)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape

from linnet_core.dtypes import FORMATS, normalize_format
from linnet_core.serve.config import ServeConfig
from linnet_core.units import format_size

from ..options import (
    BackendName,
    BackendOpt,
    BurstWaitOpt,
    CacheLenOpt,
    DecodeStallOpt,
    DtypeOpt,
    JsonOpt,
    MaxWaitingOpt,
    ModelArg,
    PrefillChunkOpt,
    PrefixCachingOpt,
    QuietOpt,
    RevisionOpt,
    RowsOpt,
)
from ..output import Sink, handle_errors

export_app = typer.Typer(help="Export a model for another runtime.", no_args_is_help=True)
OutArg = Annotated[Path, typer.Argument(help="Folder to create (refused if it exists, unless --force).",
                                        show_default=False)]
ForceOpt = Annotated[bool, typer.Option("--force", help="Replace OUT if it exists.")]
NoCheckOpt = Annotated[bool, typer.Option("--no-check", help="Skip the round trip through the consumer.")]
CHECKERS = ("llama.cpp", "transformers")


def _gguf_dtype(value: str) -> str:
    from linnet_core.export.gguf_export import GGUF_DTYPES, GGUF_FORMATS  # imports torch: not at start-up

    if value == "auto":
        return value
    canonical = normalize_format(value)
    if canonical not in GGUF_FORMATS:
        raise typer.BadParameter(f"'{value}' is not one of auto, {', '.join(GGUF_DTYPES)}")
    return FORMATS[canonical].gguf


def _checker(value: str | None) -> str | None:
    if value is not None and value not in CHECKERS:
        raise typer.BadParameter(f"'{value}' is not one of {', '.join(CHECKERS)}")
    return value


def _report(sink: Sink, result, extra: dict) -> None:
    lines = [escape(str(result.out))] + [f"  {escape(name):<34} {format_size(size):>10}" for name, size in result.files.items()]
    lines.append(f"[dim]{len(result.files)} files · {format_size(result.total_bytes)} · {result.seconds:.1f} s[/]")
    if result.check is not None:
        lines.append(escape(result.check.describe()))
    lines += [f"[yellow]note:[/] {escape(n)}" for n in result.notes]
    check = result.check.to_json() if result.check is not None else None
    sink.data("\n".join(lines), {"out": str(result.out), "files": result.files, "bytes": result.total_bytes,
                                 "seconds": round(result.seconds, 3), "check": check, "notes": result.notes,
                                 **extra})


@export_app.command("onnx")
@handle_errors
def export_onnx_command(
    model: ModelArg,
    out: OutArg,
    dtype: DtypeOpt = "float32",
    cache_len: CacheLenOpt = None,
    force: ForceOpt = False,
    revision: RevisionOpt = None,
    json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """The ONNX graph (prefill and batched decode over a static KV cache), its external weights,
    interface.json (entry points, input/output names, cache layout) and the tokenizer files."""
    # The core (and torch) load here, not at CLI start-up, so --help and completion stay fast.
    from linnet_core.export.onnx_export import export_onnx  # imports torch: not at start-up

    sink = Sink(json, quiet)
    sink.info(f"exporting {model} to ONNX ({dtype})...")
    result = export_onnx(model, out, dtype, cache_len, force, revision)
    _report(sink, result, {"format": "onnx", "dtype": dtype})


@export_app.command("hf")
@handle_errors
def export_hf_command(
    model: ModelArg,
    out: OutArg,
    dtype: DtypeOpt = "auto",
    max_shard_size: Annotated[str, typer.Option("--max-shard-size", help="Largest safetensors shard (5GB, 500MB, ...).")] = "5GB",
    no_check: NoCheckOpt = False,
    force: ForceOpt = False,
    revision: RevisionOpt = None,
    json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """A Hugging Face checkpoint for vLLM, SGLang, TGI and transformers: sharded safetensors with
    their index, config.json in both config styles, generation_config.json, tokenizer and chat
    template. Unless --no-check, transformers loads it back and its logits are compared with the
    source's before OUT appears."""
    from linnet_core.export.hf_export import export_hf  # imports torch: not at start-up

    sink = Sink(json, quiet)
    sink.info(f"exporting {model} as a Hugging Face checkpoint ({dtype})...")
    result = export_hf(model, out, dtype, force, revision, max_shard_size, check=not no_check)
    _report(sink, result, {"format": "hf", "dtype": dtype})


@export_app.command("gguf")
@handle_errors
def export_gguf_command(
    model: ModelArg,
    out: Annotated[Path, typer.Argument(help="The .gguf file to create (refused if it exists, unless --force).",
                                        show_default=False)],
    dtype: Annotated[str, typer.Option("--dtype", "-d", callback=_gguf_dtype, metavar="[auto|f32|f16|bf16|q8_0|q4_0]",
                                       help="Weight type; auto = the checkpoint's; q8_0 and q4_0 hold the very blocks a Linnet artifact of that dtype does "
                                            "(ggml's rounding; norms f32, the output head q8_0).")] = "auto",
    check_with: Annotated[Optional[str], typer.Option(
        "--check-with", callback=_checker, metavar="[llama.cpp|transformers]",
        help="Engine for the round trip (default: llama.cpp if installed, else transformers).")] = None,
    no_check: NoCheckOpt = False,
    force: ForceOpt = False,
    revision: RevisionOpt = None,
    json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """One GGUF file for llama.cpp: its architecture keys and tensor layout, the vocabulary, merges,
    special tokens and chat template. Unless --no-check, llama.cpp (or transformers) loads it back
    and its logits are compared with the source's before OUT appears."""
    from linnet_core.export.gguf_export import export_gguf  # imports torch: not at start-up

    sink = Sink(json, quiet)
    sink.info(f"exporting {model} as GGUF ({dtype})...")
    result = export_gguf(model, out, dtype, force, revision, check=not no_check, consumer=check_with)
    _report(sink, result, {"format": "gguf", "dtype": dtype})


@export_app.command("triton")
@handle_errors
def export_triton_command(
    model: ModelArg,
    out: OutArg,
    backend: BackendOpt = BackendName.torch,
    dtype: DtypeOpt = "auto",
    rows: RowsOpt = ServeConfig.rows,
    cache_len: CacheLenOpt = None,
    prefill_chunk: PrefillChunkOpt = ServeConfig.prefill_chunk,
    max_waiting: MaxWaitingOpt = ServeConfig.max_waiting,
    decode_stall: DecodeStallOpt = ServeConfig.decode_stall,
    burst_wait: BurstWaitOpt = ServeConfig.burst_wait_ms,
    prefix_caching: PrefixCachingOpt = ServeConfig.prefix_caching,
    name: Annotated[Optional[str], typer.Option("--name", help="Model name in the repository.")] = None,
    env: Annotated[Optional[Path], typer.Option(
        "--env", help="Python environment Triton runs the model in (linnet installed, numpy < 2); "
                      "written as EXECUTION_ENV_PATH.", show_default=False)] = None,
    force: ForceOpt = False,
    json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """A Triton Inference Server model repository: OUT/NAME/config.pbtxt (python backend, decoupled,
    text_input / max_tokens / stream / sampling_parameters in, text_output / finish_reason out) and
    OUT/NAME/1/model.py, which runs the same continuous-batching engine as `linnet serve`, configured by
    the linnet_* parameters config.pbtxt holds (the engine options here; edit them there later)."""
    from linnet_core.serve.triton import export_triton  # imports torch: not at start-up

    sink = Sink(json, quiet)
    config = ServeConfig(model, backend.value, dtype, rows, cache_len, prefill_chunk, max_waiting, decode_stall,
                         burst_wait, prefix_caching)
    result = export_triton(model, out, config, name, env, force)
    _report(sink, result, {"format": "triton", "backend": backend.value, "dtype": dtype})
