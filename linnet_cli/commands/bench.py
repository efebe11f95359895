"""linnet bench: every backend available here and the stacks they replace, side by side."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from linnet_core.backends import BACKEND_NAMES
from linnet_core.bench import llama_server
from linnet_core.bench.subjects import COMPARATORS, Method, pick
from linnet_core.check.baseline import bench_gate, read_saved
from linnet_core.errors import InputError
from linnet_core.serve.config import ServeConfig

from ..options import (AdaptiveDraftOpt, DraftBackendOpt, DraftDtypeOpt, DraftOpt, DraftTokensOpt, DtypeOpt, JsonOpt,
                       OptionalModelArg, QuietOpt, SpeculateOpt, name_list)
from ..output import EXIT_CHECK_FAILED, EXIT_INTERRUPTED, Sink, check_output_files, handle_errors, write_json
from .bench_serving import HIDDEN, run_serving


@handle_errors
def bench_command(
    model: OptionalModelArg = None,
    backend: Annotated[Optional[list[str]], typer.Option(
        "--backend", "-b", help="Linnet backends: all (default), or names, repeated or comma-separated.")] = None,
    compare: Annotated[Optional[list[str]], typer.Option(
        "--compare", help="Comparators: all (default), none, or transformers-compiled, llama.cpp, llama-server, "
                          "vllm, sglang (transformers eager, the reference, always runs).")] = None,
    dtype: DtypeOpt = "auto",
    prompt_tokens: Annotated[int, typer.Option("--prompt-tokens", help="Prompt length (random token ids).")] = 512,
    prompt_file: Annotated[Optional[Path], typer.Option(
        "--prompt-file", help="The prompt: this file's text, tokenized, instead of --prompt-tokens random ids "
                              "(a text the output copies from, for --speculate ngram).", show_default=False)] = None,
    new_tokens: Annotated[int, typer.Option("--new-tokens", help="Tokens generated per run.")] = 128,
    batch: Annotated[int, typer.Option("--batch", help="Sequences decoded together.")] = 1,
    runs: Annotated[int, typer.Option("--runs", help="Timed runs per side (the median is reported).")] = 10,
    warmups: Annotated[int, typer.Option("--warmups", help="Untimed runs first.")] = 3,
    cache_len: Annotated[Optional[int], typer.Option("--cache-len", help="KV positions (default: prompt + new).")] = None,
    device: Annotated[str, typer.Option("--device", help="auto, cpu or cuda.")] = "auto",
    sequential: Annotated[bool, typer.Option(
        "--sequential", help="One side loaded at a time, its runs back to back (models too big to hold once "
                             "per side); default: all loaded, runs interleaved.")] = False,
    time_limit: Annotated[Optional[float], typer.Option(
        "--time-limit", min=1, help="Seconds: stop near this, keeping what was measured (a side not reached "
                                    "is listed as such); measures one side at a time, the reference and "
                                    "Linnet's first; default: none.", show_default=False)] = None,
    html: Annotated[Optional[Path], typer.Option("--html", help="Write the page (one self-contained HTML file).",
                                                 show_default=False)] = None,
    markdown: Annotated[bool, typer.Option("--markdown", help="Print the table as Markdown.")] = False,
    save: Annotated[Optional[Path], typer.Option("--save", help="Also write the --json document to this file.",
                                                 show_default=False)] = None,
    workdir: Annotated[Optional[Path], typer.Option("--workdir", help="Keep exports and worker logs here.",
                                                    show_default=False)] = None,
    baseline: Annotated[Optional[Path], typer.Option(
        "--baseline", help="A saved --json run of the same command on this machine: exit 3 when a side's median "
                           "decode tok/s or TTFT is slower by more than --max-slowdown and beyond the runs' noise "
                           "(one-sided Mann-Whitney U, p ≤ 0.05; --runs 3 at least).", show_default=False)] = None,
    max_slowdown: Annotated[str, typer.Option(
        "--max-slowdown", help="--baseline: the slowdown allowed, as a percentage (5%) or a fraction (0.05).")] = "5%",
    other_machine: Annotated[bool, typer.Option(
        "--other-machine",
        help="--baseline from another machine: compare, with a warning (default: refused).")] = False,
    speculate: SpeculateOpt = None,
    draft: DraftOpt = None,
    draft_tokens: DraftTokensOpt = 4,
    adaptive_draft: AdaptiveDraftOpt = True,
    draft_backend: DraftBackendOpt = None,
    draft_dtype: DraftDtypeOpt = "auto",
    serving: Annotated[bool, typer.Option("--serving", help="Measure serving many requests at once instead: "
                                          "`linnet bench-serving`, whose options this command takes too.")] = False,
    requests: HIDDEN.Requests = 256,
    prompt_range: HIDDEN.PromptRange = "128-512",
    concurrency: HIDDEN.Concurrency = 64,
    rate: HIDDEN.Rate = None,
    shared_prefix: HIDDEN.SharedPrefix = 0,
    turns: HIDDEN.Turns = 1,
    rows: HIDDEN.Rows = 64,
    prefill_chunk: HIDDEN.PrefillChunk = ServeConfig.prefill_chunk,
    decode_stall: HIDDEN.DecodeStall = ServeConfig.decode_stall,
    burst_wait: HIDDEN.BurstWait = ServeConfig.burst_wait_ms,
    prefix_caching: HIDDEN.PrefixCaching = ServeConfig.prefix_caching,
    target: HIDDEN.Target = None,
    rounds: HIDDEN.Rounds = 1,
    url: HIDDEN.Url = None,
    api_key: HIDDEN.ApiKey = None,
    build_llama_server: HIDDEN.BuildLlamaServer = False,
    request_fields: HIDDEN.RequestFields = None,
    json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Time to first token, decode speed, load time, peak memory and distance from reference for
    each Linnet backend and each comparator installed here, in one run with the runs interleaved;
    speed-ups against transformers from the same run, and the decode roofline."""
    from linnet_core.bench.run import bench  # imports torch: not at start-up
    from linnet_core.speculation import SpeculationOptions  # imports torch: not at start-up

    sink = Sink(json, quiet)
    if device not in ("auto", "cpu", "cuda"):
        raise InputError(f"unknown device '{device}' (choose from: auto, cpu, cuda)")
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    check_output_files(html, save)
    gate = _baseline(baseline, max_slowdown) if baseline is not None else None  # a bad file: refused before the runs
    wanted = SpeculationOptions(speculate, draft, draft_tokens, adaptive_draft,
                                draft_backend.value if draft_backend else None, draft_dtype)
    if serving and wanted.chosen:
        raise InputError("--speculate and --draft time one sequence's decode: drop --serving "
                         "(a server speculates with `linnet serve --speculate`)")
    if serving and time_limit is not None:
        raise InputError("--time-limit bounds the decode bench; --serving is bounded by --requests")
    if serving:
        if gate is not None:
            raise InputError("--baseline gates the decode bench; compare serving runs with bench-serving's report")
        names = name_list(backend, (), "torch")
        if len(names) != 1:
            raise InputError("--serving measures one backend at a time: give one --backend")
        config = ServeConfig(model, names[0], dtype, rows, None, prefill_chunk, ServeConfig.max_waiting, decode_stall,
                             burst_wait, prefix_caching)
        run_serving(sink, config, new_tokens, requests, prompt_range, concurrency, rate, shared_prefix, turns, target,
                    rounds, url, api_key, build_llama_server, html, save, markdown, request_fields)
        return
    method = Method(prompt_tokens, new_tokens, batch, runs, warmups, dtype, cache_len,
                    speculation=wanted if wanted.chosen else None,
                    prompt_file=str(prompt_file) if prompt_file else None)
    if build_llama_server:
        if llama_server.find() is None:
            sink.info("building llama-server (once, minutes)")
            llama_server.build(progress=sink.info)
    subjects = pick(name_list(backend, BACKEND_NAMES, "all"), name_list(compare, tuple(COMPARATORS), "all"))
    reporter = _progress(sink)
    try:
        result = bench(model, method, subjects, device, workdir, reporter, sequential=sequential,
                       time_limit=time_limit)
    finally:
        reporter.close()
    doc, verdict = result.to_json(), None
    if gate is not None:
        verdict = doc["baseline"] = bench_gate(doc, gate[0], baseline, gate[1], other_machine,
                                               warn=lambda text: sink.err.print(f"warning: {text}"))
    if html is not None:
        from linnet_core.bench.page import render  # imports torch: not at start-up

        command = "linnet " + " ".join(shlex.quote(a) for a in sys.argv[1:])
        html.write_text(render(result, command), encoding="utf-8")
        sink.info(f"wrote {html}")
    write_json(sink, save, doc)
    if json:
        sink.data("", doc)
    elif markdown:
        from linnet_core.bench.report import markdown as to_markdown  # imports torch: not at start-up

        sys.stdout.write(to_markdown(result))  # as is: no Rich markup in Markdown
    elif not quiet:
        from linnet_core.bench.report import rich_table  # imports torch: not at start-up

        sink.out.print(rich_table(result))
    if verdict is not None:  # shown even with --quiet: a failed gate is what the job is for
        line = (("[green]ok[/]" if verdict["passed"] else "[bold red]FAIL[/]") + f" against {baseline}: "
                + verdict["summary"] + (f" · changed: {', '.join(verdict['versions_changed'])}"
                                        if verdict["versions_changed"] else ""))
        sink.info(line) if verdict["passed"] else sink.err.print(line)
        if not verdict["passed"]:
            raise typer.Exit(EXIT_CHECK_FAILED)
    if result.time_limited:
        sink.info(f"--time-limit {time_limit:g} s ran out: the table holds what was measured by then")
    if result.interrupted:
        sink.info("interrupted: the table holds what was measured before Ctrl-C")
        raise typer.Exit(EXIT_INTERRUPTED)


def _baseline(path: Path, max_slowdown: str) -> tuple[dict, float]:
    """The saved run and the allowed slowdown as a fraction, both checked before any run."""
    text = max_slowdown.strip()
    try:
        bound = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        raise InputError(f"--max-slowdown must be a percentage (5%) or a fraction (0.05), "
                         f"got '{max_slowdown}'") from None
    if not 0 <= bound < 1:
        raise InputError(f"--max-slowdown must be from 0% to below 100%, got '{max_slowdown}'")
    return read_saved(path, "sides", "linnet bench"), bound


class _progress:
    """Stages as lines and the runs as a bar, on stderr; nothing with --json or --quiet."""

    def __init__(self, sink: Sink):
        self.sink, self.bar, self.task = sink, None, None
        self.quiet = sink.quiet or sink.json_mode

    def stage(self, text: str) -> None:
        if self.bar is not None and self.task is not None:
            self.bar.update(self.task, description=text)
        else:
            self.sink.info(f"[dim]{text}...[/]")

    def total(self, n: int) -> None:
        if self.quiet or n == 0:
            return
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )

        self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                            console=self.sink.err, transient=True)
        self.bar.start()
        self.task = self.bar.add_task("runs", total=n)

    def advance(self, text: str) -> None:
        if self.bar is not None:
            self.bar.update(self.task, advance=1, description=text)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None
