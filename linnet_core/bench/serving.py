"""`linnet bench --serving`: many requests at once, against the engine in-process, over HTTP, or any
OpenAI-compatible server (`--url`: vLLM, llama-server, another `linnet serve`).

N requests with prompt lengths drawn from a range (random token ids), a fixed number of new tokens
with end-of-sequence ignored, at most C in flight, optionally arriving as a Poisson process. The
baseline is the same requests one after another through `linnet run`'s generation loop, so the
speed-up is what continuous batching buys. Steady state needs at least ~5x as many requests as
the concurrency; the report says so when a run has fewer. Two shapes exercise prefix caching: a
system prompt shared by every request (`shared_prefix` tokens before each), and chats of `turns`
requests, each turn's prompt the one before, an answer and a new question.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
from pathlib import Path
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from ..errors import InputError
from ..serve.engine import DECODE_STALL


@dataclass(frozen=True)
class Workload:
    requests: int = 256
    prompt_min: int = 128
    prompt_max: int = 512
    new_tokens: int = 128
    concurrency: int = 64
    rate: float | None = None  # requests/s, Poisson arrivals; None = all at once (bounded by concurrency)
    seed: int = 0
    shared_prefix: int = 0  # tokens of one system prompt before every request's own
    turns: int = 1  # requests per chat; a chat's turns go one after another

    def __post_init__(self):
        if self.requests < 1 or self.concurrency < 1 or self.new_tokens < 1:
            raise InputError("--requests, --concurrency and --new-tokens must be at least 1")
        if not 1 <= self.prompt_min <= self.prompt_max:
            raise InputError(f"bad prompt range {self.prompt_min}-{self.prompt_max}")
        if self.rate is not None and self.rate <= 0:
            raise InputError(f"--rate must be positive, got {self.rate}")
        if self.shared_prefix < 0 or self.turns < 1:
            raise InputError("--shared-prefix must be at least 0 and --turns at least 1")
        if self.requests % self.turns:
            raise InputError(f"--requests ({self.requests}) must be a multiple of --turns ({self.turns})")

    @property
    def longest_prompt(self) -> int:
        return self.shared_prefix + self.turns * self.prompt_max + (self.turns - 1) * self.new_tokens

    def compose(self, pieces: list[list[int]], vocab: int) -> list[list[int]]:
        """The requests' prompts from their own parts: the shared system prompt before each, and a
        chat's earlier turns (an answer of `new_tokens` after each) before its later ones."""
        rng = np.random.default_rng(self.seed + 7)
        system = rng.integers(0, vocab, self.shared_prefix).tolist()
        prompts = []
        for i, piece in enumerate(pieces):
            if i % self.turns == 0:
                prompts.append(system + piece)
            else:
                prompts.append(prompts[-1] + rng.integers(0, vocab, self.new_tokens).tolist() + piece)
        return prompts

    @property
    def steady(self) -> bool:
        return self.requests >= 5 * self.concurrency

    def prompts(self, vocab: int) -> list[list[int]]:
        rng = np.random.default_rng(self.seed)
        lengths = rng.integers(self.prompt_min, self.prompt_max + 1, self.requests)
        return [rng.integers(0, vocab, int(n)).tolist() for n in lengths]

    def describe(self) -> str:
        arrival = f"Poisson at {self.rate:g} req/s" if self.rate else "all at once"
        shape = f" after a {self.shared_prefix}-token shared system prompt" if self.shared_prefix else ""
        if self.turns > 1:
            shape += f", in chats of {self.turns} turns (each turn's prompt holds the earlier ones)"
        return (f"{self.requests} requests of {self.prompt_min}-{self.prompt_max} prompt tokens{shape} and "
                f"{self.new_tokens} new, at most {self.concurrency} in flight, {arrival}")


@dataclass
class RequestResult:
    ok: bool
    start: float
    token_times: list[float] = field(default_factory=list)
    end: float = 0.0
    error: str | None = None
    retried: bool = False  # sent again once: the first connection closed before any answer

    def failed(self, error: str, keep_tokens: bool = False) -> "RequestResult":
        """This request, ended now with `error`; the tokens it had timed count only where `keep_tokens`."""
        self.ok, self.end, self.error = False, time.perf_counter(), error
        if not keep_tokens:
            self.token_times = []
        return self

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.start if self.token_times else None

    @property
    def tpot(self) -> float | None:
        n = len(self.token_times)
        return (self.token_times[-1] - self.token_times[0]) / (n - 1) if n > 1 else None


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def summarize(name: str, results: list[RequestResult], wall: float, workload: Workload,
              peak_memory: int | None = None, note: str = "") -> dict:
    ok = [r for r in results if r.ok]
    tokens = sum(len(r.token_times) for r in ok)
    ttft = [r.ttft for r in ok if r.ttft is not None]
    tpot = [r.tpot for r in ok if r.tpot is not None]
    itl = [b - a for r in ok for a, b in itertools.pairwise(r.token_times)]
    e2e = [r.end - r.start for r in ok]
    ms = 1000.0
    row = {"target": name, "requests": len(results), "failed": len(results) - len(ok), "output_tokens": tokens,
           "wall_s": wall, "output_tok_s": tokens / wall if wall else None, "request_s": len(ok) / wall if wall else None,
           "peak_memory_bytes": peak_memory, "note": note, "retried": sum(r.retried for r in results),
           "errors": sorted({r.error for r in results if r.error})[:5]}
    for key, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2e", e2e)):
        row[f"{key}_ms_median"] = _pct(values, 50) * ms if values else None
        row[f"{key}_ms_p99"] = _pct(values, 99) * ms if values else None
    return row


async def _paced(workload: Workload, prompts: list, one) -> tuple[list[RequestResult], float]:
    """Run `one(prompt)` for every prompt: at most `concurrency` at once, arriving as the workload says
    (a chat arrives as a whole, and its turns go one after another)."""
    sem = asyncio.Semaphore(workload.concurrency)
    rng = np.random.default_rng(workload.seed + 1)
    t0 = time.perf_counter()
    chats = [prompts[i:i + workload.turns] for i in range(0, len(prompts), workload.turns)]

    async def guarded(chat: list, delay: float) -> list[RequestResult]:
        await asyncio.sleep(delay)
        out = []
        for prompt in chat:
            async with sem:
                out.append(await one(prompt))
        return out

    delays = np.cumsum(rng.exponential(1 / workload.rate, len(chats))) if workload.rate else [0.0] * len(chats)
    results = await asyncio.gather(*(guarded(c, float(d)) for c, d in zip(chats, delays, strict=True)))
    return [r for chat in results for r in chat], time.perf_counter() - t0


def round_trippable(workload: Workload, model) -> list[list[int]]:
    """The workload's prompts. With a tokenizer they are drawn from its vocabulary and made stable
    under decode-then-encode, so a target that takes text (Triton) gets the same prompts."""
    from ..errors import CheckpointError
    from ..tokenizer import Tokenizer

    try:
        tok = Tokenizer(model.path)
    except CheckpointError:
        return workload.compose(workload.prompts(model.spec.vocab_size), model.spec.vocab_size)
    vocab = min(tok.vocab_size, model.spec.vocab_size)
    prompts = []
    for p in workload.prompts(vocab):
        for _ in range(3):  # a couple of rounds settle it; lengths stay in the range
            again = tok.encode(tok.decode(p), add_special_tokens=False)
            p = (again + p)[:len(p)] if len(again) < len(p) else again[:len(p)]
        prompts.append(p)
    return workload.compose(prompts, vocab)


def run_in_process(engine, workload: Workload, prompts: list[list[int]]) -> tuple[list[RequestResult], float]:
    """Against an Engine in this process (started here), as the HTTP face drives it."""
    from ..serve import Mailbox
    from ..serve.engine import GenerationRequest

    async def one(prompt: list[int], mailbox: Mailbox) -> RequestResult:
        q: asyncio.Queue = asyncio.Queue()
        res = RequestResult(True, time.perf_counter())
        try:
            handle = engine.submit(GenerationRequest(prompt, workload.new_tokens, ignore_eos=True))
        except InputError as e:
            return RequestResult(False, res.start, error=e.message)
        handle.subscribe(lambda d: mailbox.post(q, (time.perf_counter(), d)))
        while True:
            at, d = await q.get()
            res.token_times += [at] * len(d.token_ids)
            if d.finish_reason is not None:
                res.ok, res.error, res.end = d.finish_reason == "length", d.error, at
                return res

    async def main():
        mailbox = Mailbox(asyncio.get_running_loop())
        return await _paced(workload, prompts, lambda prompt: one(prompt, mailbox))

    engine.start()
    return asyncio.run(main())


async def _stream(client, path: str, body: dict, tokens_in) -> RequestResult:
    """POST a streaming request and time its tokens; `tokens_in(event)` says how many tokens one
    Server-Sent Event carries (its JSON, parsed)."""
    import httpx

    res = RequestResult(True, time.perf_counter())
    try:
        try:
            response = await client.send(client.build_request("POST", path, json=body), stream=True)
        except httpx.RemoteProtocolError:
            # A kept-alive connection the server had just closed (llama-server's httplib closes one after
            # a few requests): nothing was sent or answered, so the request goes again on a fresh one.
            res.retried = True
            response = await client.send(client.build_request("POST", path, json=body), stream=True)
        async with contextlib.aclosing(response) as r:
            if r.status_code != 200:
                await r.aread()
                return res.failed(f"HTTP {r.status_code}: {r.text[:200]}")
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    event = json.loads(line[6:])
                    if isinstance(event, dict) and event.get("error"):  # the server gave up mid-stream
                        return res.failed(f"the server's error event: {json.dumps(event['error'])[:160]}",
                                          keep_tokens=True)
                    n = tokens_in(event, len(res.token_times))
                    res.token_times += [time.perf_counter()] * n
    except httpx.HTTPError as e:  # the reason in the report: "RemoteProtocolError: peer closed connection ..."
        return res.failed(f"{type(e).__name__}: {e}"[:200])
    except (ValueError, KeyError, TypeError, IndexError) as e:
        return res.failed(f"an event that is not a completion chunk ({type(e).__name__}: {e})"[:200])
    res.end = time.perf_counter()
    return res


def _client(url: str, workload: Workload, headers: dict | None = None):
    import httpx

    return httpx.AsyncClient(base_url=url.rstrip("/"), headers=headers or {}, timeout=600,
                             limits=httpx.Limits(max_connections=workload.concurrency + 8))


def _openai_tokens(chunk: dict, seen: int) -> int:
    choice = (chunk.get("choices") or [{}])[0]
    if choice.get("finish_reason") is None:  # one chunk per token
        return 1
    if chunk.get("usage"):  # the closing chunk: its count settles the total
        return max(0, chunk["usage"]["completion_tokens"] - seen)
    return 1 if choice.get("text") else 0  # no usage: a closing chunk with text is a token


def server_root(url: str) -> str:
    """The server's root from an address as people write it: `http://host:port`, or the `/v1` base
    OpenAI clients take (`http://host:port/v1/`)."""
    base = url.strip().rstrip("/")
    if not base.startswith(("http://", "https://")):
        raise InputError(f"--url must start with http:// or https://, got '{url}'")
    return base[:-3] if base.endswith("/v1") else base


async def served_model(client, url: str) -> str:
    """The first model the server lists at /v1/models, or one line saying what it answered instead."""
    import httpx

    where = f"{url.rstrip('/')}/v1/models"
    try:
        r = await client.get("/v1/models")
    except httpx.HTTPError as e:
        raise InputError(f"cannot reach {where}: {type(e).__name__}: {e}") from None
    if r.status_code != 200:
        raise InputError(f"{where} answered HTTP {r.status_code}: {r.text[:120]!r}",
                         hint="is this an OpenAI-compatible server? (--api-key if it needs one)")
    try:
        models = r.json()["data"]
        return str(models[0]["id"])
    except (ValueError, KeyError, IndexError, TypeError):
        raise InputError(f"{where} answered, but not with an OpenAI model list: {r.text[:120]!r}",
                         hint="is this an OpenAI-compatible server?") from None


def run_http(url: str, workload: Workload, prompts: list[list[int]], model: str | None = None,
             api_key: str | None = None, extra: dict | None = None) -> tuple[list[RequestResult], float]:
    """Against any OpenAI-compatible server: streamed /v1/completions with the prompt as token ids
    (`extra`: server-specific fields added to every request)."""
    root = server_root(url)

    async def main():
        async with _client(root, workload, {"Authorization": f"Bearer {api_key}"} if api_key else None) as client:
            name = model or await served_model(client, root)

            async def one(prompt: list[int]) -> RequestResult:
                body = {"model": name, "prompt": prompt, "max_tokens": workload.new_tokens, "stream": True,
                        "ignore_eos": True, "temperature": 0, "min_tokens": workload.new_tokens, **(extra or {})}
                return await _stream(client, "/v1/completions", body, _openai_tokens)

            return await _paced(workload, prompts, one)

    return asyncio.run(main())


def run_triton(url: str, name: str, workload: Workload, texts: list[str]) -> tuple[list[RequestResult], float]:
    """Against Triton's generate_stream on a Linnet model repository: text in (Triton's model takes text),
    one event per token, a closing event with the finish reason."""
    params = json.dumps({"ignore_eos": True, "temperature": 0})

    async def main():
        async with _client(url, workload) as client:
            async def one(text: str) -> RequestResult:
                body = {"text_input": text, "max_tokens": workload.new_tokens, "stream": True,
                        "sampling_parameters": params}
                return await _stream(client, f"/v2/models/{name}/generate_stream", body,
                                     lambda event, seen: 0 if event.get("finish_reason") else 1)

            return await _paced(workload, texts, one)

    return asyncio.run(main())


def run_sequential(session, workload: Workload, prompts: list[list[int]]) -> tuple[list[RequestResult], float]:
    """The baseline: the same requests one after another through `linnet run`'s generation loop."""
    from ..runtime.generate import Generation

    results, t0 = [], time.perf_counter()
    for prompt in prompts:
        res = RequestResult(True, time.perf_counter())
        for _ in Generation(session, prompt, workload.new_tokens):
            res.token_times.append(time.perf_counter())
        res.end = time.perf_counter()
        results.append(res)
    return results, time.perf_counter() - t0


def report_rows(rows: list[dict], baseline: str = "sequential") -> list[dict]:
    base = next((r for r in rows if r["target"] == baseline), None)
    for r in rows:
        r["speedup"] = (r["output_tok_s"] / base["output_tok_s"]) if base and base["output_tok_s"] and \
            r["output_tok_s"] else None
    return rows


def to_json(workload: Workload, rows: list[dict], env: dict, model: str, backend: str, rows_n: int) -> dict:
    return {"model": model, "backend": backend, "rows": rows_n, "workload": asdict(workload),
            "steady_state": workload.steady, "environment": env, "targets": rows}



LABELS = {"engine": "linnet.serve, in-process", "http": "linnet serve, over HTTP", "sequential": "one at a time (linnet run)",
          "http-no-prefix-cache": "linnet serve, prefix caching off", "triton": "Triton, linnet.serve backend",
          "llama-server": "llama-server (llama.cpp)", "url": "OpenAI-compatible server at --url"}
TARGETS = ("sequential", "engine", "http", "http-no-prefix-cache", "llama-server", "triton")


def _start_server(model: str, backend: str, dtype: str, rows: int, cache_len: int,
                  extra: tuple[str, ...] = ()) -> tuple[subprocess.Popen, str]:
    """`linnet serve` in a process of its own, ready to take requests."""
    import httpx

    from ..serve import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "linnet_cli", "serve", model, "--backend", backend, "--dtype", dtype,
                             "--rows", str(rows), "--cache-len", str(cache_len), "--port", str(port), "--quiet",
                             "--max-waiting", "100000", *extra],
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


def bench_serving(model, workload: Workload, backend: str = "torch", dtype: str = "auto", rows: int = 8,
                  targets: tuple[str, ...] = ("sequential", "engine", "http"), url: str | None = None,
                  api_key: str | None = None, rounds: int = 1, progress=lambda text: None,
                  decode_stall: float | None = DECODE_STALL) -> dict:
    """Every target `rounds` times, interleaved (a shared machine's drift lands on all of them);
    each target's row is its median round by output tokens/s, with every round's figure beside it."""
    from ..compile import open_model, pick_dtype
    from .machine import environment

    if rounds < 1:
        raise InputError(f"--rounds must be at least 1, got {rounds}")
    m = open_model(model) if not hasattr(model, "spec") else model
    dt = pick_dtype(dtype, m.spec)
    cache_len = workload.longest_prompt + workload.new_tokens
    prompts = round_trippable(workload, m)
    measured: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="linnet-serving-") as scratch:
        gguf = _gguf_for_llama_server(m, dt, Path(scratch), progress) if "llama-server" in targets else None
        for k in range(rounds):
            for target in targets + (("url",) if url else ()):
                name = url if target == "url" else LABELS[target]
                progress(f"serving bench: {name}" + (f" (round {k + 1} of {rounds})" if rounds > 1 else ""))
                if target == "llama-server":
                    row = _llama_server_target(gguf, rows, cache_len, workload, prompts, Path(scratch))
                else:
                    row = _measure(target, m, backend, dt, rows, cache_len, workload, prompts, url, api_key, progress,
                                   decode_stall)
                row["label"] = name
                measured.setdefault(target, []).append(row)
    chosen = []
    for runs in measured.values():
        by_speed = sorted(runs, key=lambda r: r["output_tok_s"] or 0.0)
        row = by_speed[(len(by_speed) - 1) // 2]
        row["rounds_output_tok_s"] = [r["output_tok_s"] for r in runs]
        chosen.append(row)
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    result = to_json(workload, report_rows(chosen), environment(device), str(m.resolved.name), backend, rows)
    result["rounds"], result["decode_stall"] = rounds, decode_stall
    return result


def _measure(target: str, m, backend: str, dtype: str, rows: int, cache_len: int, workload: Workload,
             prompts: list[list[int]], url: str | None, api_key: str | None, progress,
             decode_stall: float | None = DECODE_STALL) -> dict:
    """One round of one target: its summary row."""
    from ..compile import load_model
    from ..serve.engine import Engine
    from .machine import peak_rss

    if target == "sequential":
        session, _ = load_model(m, backend, dtype, cache_len, rows=1)
        results, wall = run_sequential(session, workload, prompts)
        return summarize("sequential", results, wall, workload, peak_rss(), "peak RSS of this process")
    if target == "engine":
        session, _ = load_model(m, backend, dtype, cache_len, rows=rows)
        engine = Engine(session, None, prefill_chunk=256, max_waiting=workload.requests + 1, decode_stall=decode_stall)
        try:
            results, wall = run_in_process(engine, workload, prompts)
        finally:
            engine.stop(timeout=5)
        return summarize("engine", results, wall, workload, peak_rss(), "peak RSS of this process")
    if target in ("http", "http-no-prefix-cache"):
        off = target == "http-no-prefix-cache"
        proc, server = _start_server(str(m.path), backend, dtype, rows, cache_len,
                                     ("--decode-stall", str(decode_stall or 0)) + (("--no-prefix-caching",) if off else ()))
        try:
            results, wall = run_http(server, workload, prompts)
            peak = peak_rss(proc.pid)
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)
            proc.stderr.close()
        return summarize(target, results, wall, workload, peak, "peak RSS of the server process" +
                         ("; every prompt computed whole" if off else ""))
    if target == "triton":
        return _triton_target(m, backend, dtype, rows, cache_len, workload, prompts, progress)
    results, wall = run_http(url, workload, prompts, api_key=api_key)
    return summarize("url", results, wall, workload, None, url)


def _gguf_for_llama_server(m, dtype: str, scratch: Path, progress) -> Path:
    """The same weights in the bench dtype as llama.cpp reads them (a GGUF source as it is)."""
    from . import llama_server
    from .run import gguf_for_llama_cpp

    llama_server.require()  # before minutes of exporting
    return gguf_for_llama_cpp(m, dtype, scratch / "model.gguf", lambda text: progress(f"serving bench: {text}"))[0]


def _llama_server_target(gguf: Path, rows: int, cache_len: int, workload: Workload, prompts: list[list[int]],
                         scratch: Path) -> dict:
    """llama-server with a slot per Linnet row and the same positions each, started afresh for the round."""
    import torch

    from . import llama_server
    from .machine import peak_rss

    threads = torch.get_num_threads()
    proc, url, workaround = llama_server.start(llama_server.require(), gguf, rows, cache_len, threads,
                                               scratch / "llama-server.log")
    try:
        results, wall = run_http(url, workload, prompts, extra={"cache_prompt": True})
        peak = peak_rss(proc.pid)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
    crashed = (f"; {' '.join(workaround)}: it crashed (SIGSEGV) at start-up with repacking on, as ggml's AMX "
               "matmul does on some Xeons (llama.cpp issue 20824)") if workaround else ""
    return summarize("llama-server", results, wall, workload, peak,
                     f"-np {rows} -c {rows * cache_len} -t {threads}, its default float16 KV cache; started afresh "
                     "each round (prompt cache cold), its slots' prompt reuse on as by default; peak RSS of the "
                     f"server{crashed}")


COLUMNS = (("output tok/s", "output_tok_s", "{:,.1f}"), ("speed-up", "speedup", "{:.2f}×"),
           ("req/s", "request_s", "{:.2f}"), ("TTFT med", "ttft_ms_median", "{:,.0f} ms"),
           ("TTFT p99", "ttft_ms_p99", "{:,.0f} ms"), ("TPOT med", "tpot_ms_median", "{:,.1f} ms"),
           ("ITL med", "itl_ms_median", "{:,.1f} ms"), ("ITL p99", "itl_ms_p99", "{:,.1f} ms"),
           ("e2e med", "e2e_ms_median", "{:,.0f} ms"), ("e2e p99", "e2e_ms_p99", "{:,.0f} ms"),
           ("failed", "failed", "{}"), ("peak memory", "peak_memory_bytes", "{}"))


def cell(row: dict, key: str, fmt: str) -> str:
    v = row.get(key)
    if v is None:
        return "–"
    if key == "peak_memory_bytes":
        return f"{v / 2**30:.2f} GiB"
    return fmt.format(v)


def header(result: dict) -> str:
    w = Workload(**result["workload"])
    steady = "" if result["steady_state"] else " (fewer than 5× the concurrency: not a steady state)"
    rounds = f" · median of {result['rounds']} interleaved rounds" if result.get("rounds", 1) > 1 else ""
    stall = result.get("decode_stall", DECODE_STALL)
    budget = f" · decode stall ≤ {stall:g}×" if stall else " · prompt chunks unbounded by decode"
    return (f"{result['model']} · {result['backend']}, {result['rows']} rows{budget} · {w.describe()}{steady}"
            f"{rounds}")


def markdown(result: dict) -> str:
    lines = [f"**{header(result)}**", "", "| target | " + " | ".join(c[0] for c in COLUMNS) + " |",
             "|---|" + "---:|" * len(COLUMNS)]
    for r in result["targets"]:
        lines.append(f"| {r['label']} | " + " | ".join(cell(r, k, f) for _, k, f in COLUMNS) + " |")
    if result.get("rounds", 1) > 1:
        lines += ["", "Output tok/s in each round: " + "; ".join(
            f"{r['label']} " + ", ".join(f"{x:,.1f}" for x in r["rounds_output_tok_s"]) for r in result["targets"])]
    lines += [""] + [f"- {n}" for n in notes(result)] if notes(result) else []
    return "\n".join(lines) + "\n"


def notes(result: dict) -> list[str]:
    """What each target's figures mean (how it was run), and why requests failed."""
    out = []
    for r in result["targets"]:
        if r.get("note"):
            out.append(f"{r['label']}: {r['note']}")
        if r.get("failed"):
            out.append(f"{r['label']}: {r['failed']} of {r['requests']} requests failed: " + "; ".join(r["errors"]))
        if r.get("retried"):
            out.append(f"{r['label']}: {r['retried']} requests sent again once, their first connection closed by "
                       "the server before any answer (their time counts)")
    return out


def rich_table(result: dict):
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=escape(header(result)), title_justify="left")
    table.add_column("target", no_wrap=True)
    for name, _, _ in COLUMNS:
        table.add_column(name, justify="right", no_wrap=True)
    for r in result["targets"]:
        table.add_row(escape(r["label"]), *(cell(r, k, f) for _, k, f in COLUMNS))
    return table


def _triton_target(m, backend: str, dtype: str, rows: int, cache_len: int, workload: Workload,
                   prompts: list[list[int]], progress) -> dict:
    """A local tritonserver on `linnet export triton`'s repository. Triton's model takes text, so each
    prompt is its token ids decoded (and tokenized again by the model: lengths can move a little)."""
    import tempfile

    from ..cache import cache_root
    from ..serve import free_port
    from ..serve.triton import export_triton, launch_local_triton, prepare_local_triton
    from ..tokenizer import Tokenizer
    from .machine import tree_peak_rss

    tok = Tokenizer(m.path)
    progress("serving bench: preparing a local tritonserver (nvidia-pytriton, once)")
    server, env = prepare_local_triton(cache_root() / "triton")
    with tempfile.TemporaryDirectory(prefix="linnet-triton-") as tmp:
        repo = Path(tmp) / "repo"
        # Decoded and tokenized again, a prompt can come back longer: the rows get room for that.
        export_triton(m, repo, backend, dtype, rows, 2 * cache_len, name="linnet", env=env)
        port = free_port()
        proc = launch_local_triton(repo, server, port, Path(tmp) / "triton.log")
        try:
            results, wall = run_triton(f"http://127.0.0.1:{port}", "linnet", workload,
                                       [tok.decode(p) for p in prompts])
            peak = tree_peak_rss(proc.pid)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    return summarize("triton", results, wall, workload, peak,
                     "prompts sent as text (token ids decoded); peak RSS of tritonserver and its model's stub")
