"""linnet serve: the engine behind an OpenAI-compatible HTTP API."""

from __future__ import annotations

import os
from typing import Annotated, Optional

import typer

from ..options import BackendName, BackendOpt, CacheLenOpt, DtypeOpt, OptionalModelArg, QuietOpt
from ..output import Sink, handle_errors


@handle_errors
def serve_command(
    model: OptionalModelArg = None,
    backend: BackendOpt = BackendName.torch,
    dtype: DtypeOpt = "auto",
    rows: Annotated[int, typer.Option("--rows", min=1, help="KV-cache rows: requests decoded together.")] = 8,
    cache_len: CacheLenOpt = None,
    host: Annotated[str, typer.Option("--host", help="Address to bind (0.0.0.0 to serve beyond this machine).")]
    = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=0, max=65535, help="Port to listen on.")] = 8000,
    api_key: Annotated[Optional[str], typer.Option(
        "--api-key", envvar="LINNET_API_KEY", show_envvar=True,
        help="Require 'Authorization: Bearer KEY' on every route but /health. Prefer the LINNET_API_KEY "
             "environment variable: a key on the command line shows in `ps` to every user of the machine.")] = None,
    max_waiting: Annotated[int, typer.Option("--max-waiting", min=1, help="Queued requests before 429.")] = 1024,
    max_connections: Annotated[Optional[int], typer.Option(
        "--max-connections", min=1, help="Open connections before uvicorn answers 503 (default: rows + "
        "--max-waiting + 64, room for /health and /metrics).")] = None,
    max_tokens: Annotated[Optional[int], typer.Option("--max-tokens", min=1,
                                                      help="Largest max_tokens a request may ask for.")] = None,
    prefill_chunk: Annotated[int, typer.Option(
        "--prefill-chunk", min=1, help="Prompt tokens per step, at most (taken with the decode tokens).")] = 256,
    decode_stall: Annotated[float, typer.Option(
        "--decode-stall", min=0.0, help="A step carrying prompt tokens beside decoding rows takes at most this "
        "many times a decode-only step (measured as it runs), so prompts do not stall the tokens being "
        "streamed; 0: no bound but --prefill-chunk.")] = 2.0,
    burst_wait: Annotated[float, typer.Option(
        "--burst-wait", min=0.0, help="With no row decoding, wait while requests keep arriving until this many "
        "milliseconds pass without one (2.5 times that at most), so a burst is admitted and decoded together "
        "(a steady inter-token latency; a lone request pays it in TTFT); 0: admit each at once.")] = 20.0,
    prefix_caching: Annotated[bool, typer.Option(
        "--prefix-caching/--no-prefix-caching", help="Reuse the cached positions of the longest prefix a "
        "prompt shares with a cache row (a system prompt, a chat's earlier turns).")] = True,
    drain_timeout: Annotated[float, typer.Option("--drain-timeout", help="On SIGTERM, seconds to let requests "
                                                 "in flight finish.")] = 30.0,
    name: Annotated[Optional[str], typer.Option("--name", help="Model name the API reports and expects.")] = None,
    quiet: QuietOpt = False,
) -> None:
    """Serve MODEL with continuous batching: POST /v1/completions and /v1/chat/completions (streamed
    with "stream": true), GET /v1/models, /health and /metrics (Prometheus)."""
    from linnet_core.errors import BackendUnavailable

    try:
        import uvicorn

        from linnet_core.serve.http import Limits, Server, create_app
    except ImportError as e:
        raise BackendUnavailable(f"linnet serve needs {e.name}, which is not installed",
                                 hint="pip install 'linnet[serve]'") from None
    from linnet_core.compile import load_model
    from linnet_core.errors import CheckpointError, InputError
    from linnet_core.serve.engine import Engine
    from linnet_core.serve.fields import prompt_char_limit
    from linnet_core.tokenizer import Tokenizer

    sink = Sink(False, quiet)
    if 0 < decode_stall < 1:
        raise InputError(f"--decode-stall is 0 (off) or at least 1, got {decode_stall:g}")
    session, compiled = load_model(model, backend.value, dtype, cache_len, rows=rows, progress=sink.info)
    try:
        tokenizer = Tokenizer(compiled.model.path)
    except CheckpointError:
        tokenizer = None  # token ids only
    served = name or compiled.model.resolved.name.rstrip("/").split("/")[-1]
    limits = Limits(max_tokens=min(max_tokens or session.cache_len, session.cache_len),
                    max_prompt_chars=prompt_char_limit(session.cache_len))
    engine = Engine(session, tokenizer, prefill_chunk=prefill_chunk, max_waiting=max_waiting,
                    prefix_caching=prefix_caching, decode_stall=decode_stall or None,
                    burst_wait=(burst_wait / 1000, 2.5 * burst_wait / 1000))
    app = create_app(Server(engine, tokenizer, served, limits), api_key, drain_timeout)
    sink.info(f"serving '{served}' on http://{host}:{port}/v1 ({compiled.backend}, {compiled.dtype}, {rows} rows of "
              f"{session.cache_len} positions){'; API key required' if api_key else ''}")
    uvicorn.run(app, host=host, port=port, log_level="warning" if not quiet else "error",
                timeout_graceful_shutdown=int(drain_timeout) + 1, access_log=False,
                limit_concurrency=max_connections or rows + max_waiting + 64, timeout_keep_alive=5,
                h11_max_incomplete_event_size=64 * 1024)
    os._exit(0)  # the engine thread and backend runtimes are done: skip slow interpreter teardown
