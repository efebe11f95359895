"""How each kind of target is driven and timed: an Engine in this process, any OpenAI-compatible
server over HTTP (streamed completions), Triton's generate_stream, and `linnet run`'s loop one request
after another."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

from ...check.server_api import server_root
from ...errors import InputError
from ...runtime.generate import Generation
from ...serve import Mailbox
from ...serve.engine import GenerationRequest
from .workload import RequestResult, Workload, paced


def run_in_process(engine, workload: Workload, prompts: list[list[int]]) -> tuple[list[RequestResult], float]:
    """Against an Engine in this process (started here), as the HTTP face drives it."""
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
        return await paced(workload, prompts, lambda prompt: one(prompt, mailbox))

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
                    if n < 0:  # a usage count below the tokens counted from text: it settles the total
                        del res.token_times[n:]
                    res.token_times += [time.perf_counter()] * max(n, 0)
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
    if not chunk.get("choices"):  # OpenAI's closing usage chunk (stream_options.include_usage): the total
        return chunk["usage"]["completion_tokens"] - seen if chunk.get("usage") else 0
    choice = chunk["choices"][0]
    if choice.get("finish_reason") is None:  # one chunk per token
        return 1
    if chunk.get("usage"):  # the closing chunk: its count settles the total
        return chunk["usage"]["completion_tokens"] - seen
    return 1 if choice.get("text") else 0  # no usage: a closing chunk with text is a token


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
                        "stream_options": {"include_usage": True}, "ignore_eos": True, "temperature": 0,
                        "min_tokens": workload.new_tokens, **workload.fields, **(extra or {})}
                return await _stream(client, "/v1/completions", body, _openai_tokens)

            return await paced(workload, prompts, one)

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

            return await paced(workload, texts, one)

    return asyncio.run(main())


def run_sequential(session, workload: Workload, prompts: list[list[int]]) -> tuple[list[RequestResult], float]:
    """The baseline: the same requests one after another through `linnet run`'s generation loop."""
    results, t0 = [], time.perf_counter()
    for prompt in prompts:
        res = RequestResult(True, time.perf_counter())
        for _ in Generation(session, prompt, workload.new_tokens):
            res.token_times.append(time.perf_counter())
        res.end = time.perf_counter()
        results.append(res)
    return results, time.perf_counter() - t0
