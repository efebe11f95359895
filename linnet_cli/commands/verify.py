"""linnet verify: distance from the reference (transformers, eager) with a pass/fail to gate on; with
--url, a running server's answers against the same reference."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from linnet_core.check.baseline import read_saved, verify_gate
from linnet_core.check.quant_effect import QuantEffect
from linnet_core.errors import InputError

from ..options import (
    DTYPE_HELP,
    BackendName,
    BackendOpt,
    CacheLenOpt,
    dtype_choice,
    JsonOpt,
    ModelArg,
    QuietOpt,
    RevisionOpt,
)
from ..output import EXIT_CHECK_FAILED, Sink, check_output_files, handle_errors, write_json

# No default value: a backend is verified in float32, a server in the dtype of the model it was given.
VerifyDtypeOpt = Annotated[Optional[str], typer.Option(
    "--dtype", "-d", callback=lambda v: v and dtype_choice(v), metavar="[auto|float32|float16|bfloat16|q8_0|q4_0]",
    help=DTYPE_HELP + " Default: float32; with --url, the model's own.", show_default=False)]


@handle_errors
def verify_command(
    model: ModelArg,
    backend: BackendOpt = BackendName.torch,
    dtype: VerifyDtypeOpt = None,
    steps: Annotated[int, typer.Option(min=1, help="Teacher-forced decode steps after the prefill.")] = 8,
    prompt: Annotated[Optional[str], typer.Option("--prompt", "-p", help="Prompt text (default: a fixed one).")] = None,
    cache_len: CacheLenOpt = None,
    url: Annotated[Optional[str], typer.Option(
        "--url", help="Check a running OpenAI-compatible server instead (http://host:port/v1): its greedy "
                      "answers' logprobs, tokenizer and chat template against the reference; --dtype is what "
                      "the server claims to run (default there: the model's own).", show_default=False)] = None,
    api_key: Annotated[Optional[str], typer.Option(
        "--api-key", envvar="LINNET_API_KEY", help="--url: the server's key (Authorization: Bearer).",
        show_default=False)] = None,
    served_model_name: Annotated[Optional[str], typer.Option(
        "--served-model-name", help="--url: the model name to ask for (default: the first /v1/models lists).",
        show_default=False)] = None,
    prompts: Annotated[Optional[Path], typer.Option(
        "--prompts", help="--url: more prompts, one text per line (\\n for a newline), or .jsonl lines of "
                          "{\"prompt\": ...} or {\"messages\": [...]}.", show_default=False)] = None,
    new_tokens: Annotated[int, typer.Option("--new-tokens", min=1, help="--url: greedy tokens asked per prompt.")] = 16,
    top_logprobs: Annotated[int, typer.Option(
        "--top-logprobs", min=1, max=20, help="--url: alternatives asked per position (top-k overlap, KLD).")] = 5,
    timeout: Annotated[float, typer.Option(
        "--timeout", min=0.1, help="--url: seconds to wait for each answer.")] = 120.0,
    baseline: Annotated[Optional[Path], typer.Option(
        "--baseline", help="--url: a saved --json run of the same model and dtype: exit 3 when the server's "
                           "logprobs moved beyond the tolerance since.", show_default=False)] = None,
    other_machine: Annotated[bool, typer.Option(
        "--other-machine",
        help="--baseline from another machine: compare, with a warning (default: refused).")] = False,
    save: Annotated[Optional[Path], typer.Option("--save", help="Also write the --json document to this file "
                                                 "(with --url: the --baseline of a later run).",
                                                 show_default=False)] = None,
    revision: RevisionOpt = None,
    json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Compare a backend with transformers (eager) on the same tokens (a .gguf file: with llama.cpp on
    the file), or with --url a running server; exit 3 past the tolerance."""
    sink = Sink(json, quiet)
    check_output_files(save)
    if url is not None:
        return _verify_url(sink, model, url, dtype, api_key, served_model_name, prompts, new_tokens, top_logprobs,
                           timeout, baseline, other_machine, save, revision)
    for given, flag in ((baseline, "--baseline"), (prompts, "--prompts"), (served_model_name, "--served-model-name")):
        if given is not None:
            raise InputError(f"{flag} is for checking a server: give --url too")
    # The core (and torch) load here, not at CLI start-up, so --help and completion stay fast.
    from linnet_core.check.verify import verify  # imports torch: not at start-up

    gguf = str(model or "").lower().endswith(".gguf")  # a GGUF's reference is llama.cpp on the file
    dtype = dtype or "float32"
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
    write_json(sink, save, r.to_json())
    if not r.passed:
        raise typer.Exit(EXIT_CHECK_FAILED)


def _verify_url(sink: Sink, model, url, dtype, api_key, served_model_name, prompts, new_tokens, top_logprobs,
                timeout, baseline, other_machine, save, revision) -> None:
    from linnet_core.check.served import verify_server  # imports torch: not at start-up

    old = read_saved(baseline, "comparisons", "linnet verify --url") if baseline else None  # refused before the run
    sink.info(f"verifying the server at {url} against {model}...")
    r = verify_server(model, url, dtype or "auto", api_key,
                      served_model_name, prompts, new_tokens, top_logprobs, timeout, revision,
                      progress=lambda text: sink.info(f"[dim]{text}...[/]"))
    if old is not None:
        r.baseline = verify_gate(r, old, baseline, other_machine, warn=lambda text: sink.err.print(f"warning: {text}"))
        r.passed = r.passed and r.baseline["passed"]
    write_json(sink, save, r.to_json())
    sink.data(_describe(r), r.to_json())
    if not r.passed:
        raise typer.Exit(EXIT_CHECK_FAILED)


def _describe(r) -> str:
    from rich.markup import escape

    def num(v, fmt=".3g"):
        return "—" if v is None else format(v, fmt)

    def mark(passed: bool) -> str:
        return "[green]ok[/]  " if passed else "[red]FAIL[/]"

    lines = [f"{r.served_model} at {r.url}, claimed {r.dtype}; reference: {r.reference}; "
             f"tolerance |Δ logprob| ≤ {r.tolerance:.3g}, KLD ≤ {r.kld_bound:.3g}"]
    for c in r.comparisons:
        div = "" if c.agreement == len(c.tokens) else f" (then differs at {c.agreement + 1})"
        lines.append(f"  {mark(c.passed)} {c.name:<9} {c.kind:<10} {c.prompt_tokens:>4} prompt tokens · greedy agrees "
                     f"{c.agreement}/{len(c.tokens)}{div} · max |Δ logprob| {num(c.max_dlogprob)} · "
                     f"top-{r.top_logprobs} overlap {num(c.top_overlap, '.0%')} · KLD {num(c.kld)}"
                     + (f" · {c.prompt_logprobs} prompt positions" if c.prompt_logprobs else "")
                     + (f"\n         {escape(c.finding)}" if c.finding else ""))
    tk, tp = r.tokenizer, r.template
    lines.append(f"  {mark(tk['passed'])} tokenizer "
                 f"({tk['checked'] or 'not checked'})"
                 + "".join(f"\n         {escape(f)}" for f in tk["findings"]))
    lines.append(f"  {mark(tp['passed'])} chat template "
                 f"({tp['checked'] or 'not checked'})"
                 + (f"\n         {escape(tp['finding'])}" if tp["finding"] else ""))
    for m in r.missing:
        lines.append(f"  [yellow]note[/] {escape(m)}")
    if r.baseline is not None:
        b = r.baseline
        lines.append(f"  {mark(b['passed'])} against the baseline "
                     f"{escape(b['file'])}: " + escape(b["summary"]))
    verdict = "[bold green]PASS[/]" if r.passed else "[bold red]FAIL[/]: " + ", ".join(
        r.diagnosis + (["drift from the baseline"] if r.baseline and not r.baseline["passed"] else []))
    lines.append(f"{verdict} ({r.seconds:.1f} s)")
    return "\n".join(lines)
