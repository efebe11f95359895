"""Each target of the serving bench started, driven and summarized: `linnet run`'s loop one request at a
time, the engine in this process, `linnet serve` in a process of its own (prefix caching on or off),
llama-server on the same weights, a local Triton on `linnet export triton`'s repository, any --url."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch

from ...cache import cache_root
from ...compile import Model, load_model
from ...errors import InputError
from ...serve import free_port
from ...serve.config import ServeConfig
from ...serve.engine import Engine
from ...serve.triton import export_triton, launch_local_triton, prepare_local_triton
from ...tokenizer import Tokenizer
from .. import llama_server
from ..machine import peak_rss, tree_peak_rss
from ..run import gguf_for_llama_cpp
from .clients import run_http, run_in_process, run_sequential, run_triton
from .result import TargetRow, summarize
from .workload import Workload

LABELS = {"engine": "linnet.serve, in-process", "http": "linnet serve, over HTTP", "sequential": "one at a time (linnet run)",
          "http-no-prefix-cache": "linnet serve, prefix caching off", "triton": "Triton, linnet.serve backend",
          "llama-server": "llama-server (llama.cpp)", "url": "OpenAI-compatible server at --url"}
TARGETS = ("sequential", "engine", "http", "http-no-prefix-cache", "llama-server", "triton")




@dataclass
class Round:
    """What every target of a run shares: the model, the engine's configuration (its cache length room
    for the workload's longest request), the workload and its prompts, a scratch folder."""

    model: Model
    config: ServeConfig
    workload: Workload
    prompts: list[list[int]]
    scratch: Path
    progress: Callable[[str], None]
    gguf: Path | None = None  # the weights as llama-server reads them, written once per run


def start_server(model: str, config: ServeConfig, extra: tuple[str, ...] = ()) -> tuple[subprocess.Popen, str]:
    """`linnet serve` in a process of its own, configured as `config` says, ready to take requests."""
    import httpx  # the bench's HTTP client: installed with linnet[test], not with linnet itself

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "linnet_cli", "serve", model, *config.serve_args(), "--port",
                             str(port), "--quiet", *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 1800
    while time.time() < deadline:
        if proc.poll() is not None:
            raise InputError(f"linnet serve exited: {(proc.stderr.read() or '').strip().splitlines()[-1:]}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.3)
    proc.kill()
    raise InputError("linnet serve did not become ready")


def measure(target: str, run: Round, url: str | None = None, api_key: str | None = None) -> TargetRow:
    """One round of one target: its summary row."""
    config, workload, prompts = run.config, run.workload, run.prompts
    if target == "sequential":
        session, _ = load_model(run.model, config.backend, config.dtype, config.cache_len, rows=1)
        results, wall = run_sequential(session, workload, prompts)
        return summarize("sequential", results, wall, workload, peak_rss(), "peak RSS of this process")
    if target == "engine":
        session, _ = load_model(run.model, config.backend, config.dtype, config.cache_len, rows=config.rows)
        engine = Engine.from_config(session, None, config)
        try:
            results, wall = run_in_process(engine, workload, prompts)
        finally:
            engine.stop(timeout=5)
        return summarize("engine", results, wall, workload, peak_rss(), "peak RSS of this process")
    if target in ("http", "http-no-prefix-cache"):
        off = target == "http-no-prefix-cache"
        proc, server = start_server(str(run.model.path), replace(config, prefix_caching=config.prefix_caching and not off))
        try:
            results, wall = run_http(server, workload, prompts)
            peak = peak_rss(proc.pid)
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)
            proc.stderr.close()
        return summarize(target, results, wall, workload, peak, "peak RSS of the server process" +
                         ("; every prompt computed whole" if off else ""))
    if target == "llama-server":
        return _llama_server(run)
    if target == "triton":
        return _triton(run)
    results, wall = run_http(url, workload, prompts, api_key=api_key)
    return summarize("url", results, wall, workload, None, url)


def gguf_for_llama_server(run: Round) -> Path:
    """The same weights in the bench dtype as llama.cpp reads them (a GGUF source as it is)."""
    llama_server.require()  # before minutes of exporting
    return gguf_for_llama_cpp(run.model, run.config.dtype, run.scratch / "model.gguf",
                              lambda text: run.progress(f"serving bench: {text}"))[0]


def _llama_server(run: Round) -> TargetRow:
    """llama-server with a slot per Linnet row and the same positions each, started afresh for the round."""
    rows, cache_len = run.config.rows, run.config.cache_len
    threads = torch.get_num_threads()
    proc, url, workaround = llama_server.start(llama_server.require(), run.gguf, rows, cache_len, threads,
                                               run.scratch / "llama-server.log")
    try:
        results, wall = run_http(url, run.workload, run.prompts, extra={"cache_prompt": True})
        peak = peak_rss(proc.pid)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
    crashed = (f"; {' '.join(workaround)}: it crashed (SIGSEGV) at start-up with repacking on, as ggml's AMX "
               "matmul does on some Xeons (llama.cpp issue 20824)") if workaround else ""
    return summarize("llama-server", results, wall, run.workload, peak,
                     f"-np {rows} -c {rows * cache_len} -t {threads}, its default float16 KV cache; started afresh "
                     "each round (prompt cache cold), its slots' prompt reuse on as by default; peak RSS of the "
                     f"server{crashed}")


def _triton(run: Round) -> TargetRow:
    """A local tritonserver on `linnet export triton`'s repository, configured as the other Linnet targets.
    Triton's model takes text, so each prompt is its token ids decoded (and tokenized again by the model:
    lengths can move a little)."""
    tok = Tokenizer(run.model.path)
    run.progress("serving bench: preparing a local tritonserver (nvidia-pytriton, once)")
    server, env = prepare_local_triton(cache_root() / "triton")
    with tempfile.TemporaryDirectory(prefix="linnet-triton-") as tmp:
        repo = Path(tmp) / "repo"
        # Decoded and tokenized again, a prompt can come back longer: the rows get room for that.
        export_triton(run.model, repo, replace(run.config, cache_len=2 * run.config.cache_len), name="linnet", env=env)
        port = free_port()
        proc = launch_local_triton(repo, server, port, Path(tmp) / "triton.log")
        try:
            results, wall = run_triton(f"http://127.0.0.1:{port}", "linnet", run.workload,
                                       [tok.decode(p) for p in run.prompts])
            peak = tree_peak_rss(proc.pid)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    return summarize("triton", results, wall, run.workload, peak,
                     "prompts sent as text (token ids decoded); peak RSS of tritonserver and its model's stub")
