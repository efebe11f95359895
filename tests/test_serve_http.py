"""`linnet serve`'s HTTP face, against a real uvicorn server on a free port, as clients meet it."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")

from linnet_core.compile import load_model  # noqa: E402
from linnet_core.runtime.generate import Generation  # noqa: E402
from linnet_core.serve import free_port  # noqa: E402
from linnet_core.serve.engine import Engine  # noqa: E402
from linnet_core.serve.http import Limits, Server, create_app  # noqa: E402
from linnet_core.tokenizer import Tokenizer  # noqa: E402
from server_fixtures import app_in_thread, wait_healthy  # noqa: E402

CASE = "qwen2-bias-tied"
CACHE = 128
KEY = "sk-test-key"


@pytest.fixture(scope="module")
def served(tokenized_checkpoints):
    """A server in a thread (4 rows), its base URL, and a one-row session for the alone-outputs."""
    path = tokenized_checkpoints[CASE]
    session, _ = load_model(path, "torch", "float32", CACHE, rows=4)
    alone, _ = load_model(path, "torch", "float32", CACHE, rows=1)
    tok = Tokenizer(path)
    engine = Engine(session, tok, prefill_chunk=32, max_waiting=512)
    app = create_app(Server(engine, tok, "tiny", Limits(max_tokens=CACHE, max_body_bytes=64 * 1024)), api_key=KEY)
    with app_in_thread(app) as url:
        yield url, engine, alone, tok


AUTH = {"Authorization": f"Bearer {KEY}"}


def alone_text(alone, tok, prompt_ids, n):
    return tok.decode(list(Generation(alone, prompt_ids, n)))


def test_completion_and_chat(served):
    url, engine, alone, tok = served
    r = httpx.post(f"{url}/v1/completions", headers=AUTH, json={
        "model": "tiny", "prompt": "The list object", "max_tokens": 12, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["choices"][0]["finish_reason"] == "length"
    assert body["choices"][0]["text"] == alone_text(alone, tok, tok.encode("The list object"), 12)
    assert body["usage"] == {"prompt_tokens": len(tok.encode("The list object")), "completion_tokens": 12,
                             "total_tokens": len(tok.encode("The list object")) + 12}
    chat = httpx.post(f"{url}/v1/chat/completions", headers=AUTH, json={
        "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8, "temperature": 0, "ignore_eos": True})
    assert chat.status_code == 200, chat.text
    msg = chat.json()["choices"][0]["message"]
    ids = tok.apply_chat_template([{"role": "user", "content": "Hello"}])
    assert msg["role"] == "assistant" and msg["content"] == alone_text(alone, tok, ids, 8)
    models = httpx.get(f"{url}/v1/models", headers=AUTH).json()
    assert models["data"][0]["id"] == "tiny"


def test_metrics_count_prefix_hits_and_reused_tokens(served):
    """A chat's second turn holds the first and its answer: it finds them cached, and says so."""
    url, engine, alone, tok = served

    def scrape():
        text = httpx.get(f"{url}/metrics", headers=AUTH).text
        return {k: int(float(v)) for k, v in (line.split() for line in text.splitlines()
                                              if line.startswith(("linnet_prefix_cache_", "linnet_prompt_tokens")))}

    before = scrape()
    first = tok.encode("The list object supports several methods")
    r1 = httpx.post(f"{url}/v1/completions", headers=AUTH, json={
        "prompt": first, "max_tokens": 6, "temperature": 0, "ignore_eos": True})
    answer = tok.encode(r1.json()["choices"][0]["text"])
    second = first + answer + tok.encode(" and more")
    r2 = httpx.post(f"{url}/v1/completions", headers=AUTH, json={
        "prompt": second, "max_tokens": 6, "temperature": 0, "ignore_eos": True})
    assert r2.json()["choices"][0]["text"] == alone_text(alone, tok, second, 6)
    after = scrape()
    assert after["linnet_prefix_cache_queries_total"] - before["linnet_prefix_cache_queries_total"] == 2
    assert after["linnet_prefix_cache_hits_total"] - before["linnet_prefix_cache_hits_total"] >= 1
    reused = after["linnet_prefix_cache_reused_tokens_total"] - before["linnet_prefix_cache_reused_tokens_total"]
    assert reused >= len(first)  # at least the first turn's prompt
    assert after["linnet_prompt_tokens_total"] - before["linnet_prompt_tokens_total"] == len(first) + len(second)


def sse(lines):
    chunks, done = [], False
    for line in lines:
        if not line:
            continue
        assert line.startswith("data: ") and not done
        if line == "data: [DONE]":
            done = True
            continue
        chunks.append(json.loads(line[6:]))
    assert done
    return chunks


def test_streaming_chat_matches_the_whole_answer(served):
    url, engine, alone, tok = served
    req = {"messages": [{"role": "user", "content": "Why?"}], "max_tokens": 10, "temperature": 0,
           "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{url}/v1/chat/completions", headers=AUTH, json=req) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        *chunks, usage = sse(r.iter_lines())
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks + [usage])
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    plain = {k: v for k, v in req.items() if k not in ("stream", "stream_options")}
    whole = httpx.post(f"{url}/v1/chat/completions", headers=AUTH, json=plain).json()
    assert text == whole["choices"][0]["message"]["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    # OpenAI's closing chunk: no choices, the usage; only when asked for
    assert usage["choices"] == [] and usage["usage"] == whole["usage"]
    assert not any("usage" in c for c in chunks)
    with httpx.stream("POST", f"{url}/v1/chat/completions", headers=AUTH, json={**plain, "stream": True}) as r:
        assert not any("usage" in c for c in sse(r.iter_lines()))


def test_200_concurrent_streams_with_drops(served):
    """Mixed lengths and sampling; 30% of clients hang up mid-stream; greedy ones match batch-1."""
    url, engine, alone, tok = served
    rng = random.Random(1)
    jobs = []
    for i in range(200):
        prompt = [rng.randrange(3, 380) for _ in range(rng.randrange(1, 48))]
        greedy = i % 2 == 0
        jobs.append({"prompt": prompt, "max_tokens": rng.randrange(2, 24), "stream": True, "ignore_eos": True,
                     "temperature": 0 if greedy else 0.9, "top_p": 0.95, "seed": i, "drop": i % 10 < 3})

    async def one(client, job):
        body = {k: v for k, v in job.items() if k != "drop"}
        async with client.stream("POST", f"{url}/v1/completions", headers=AUTH, json=body) as r:
            assert r.status_code == 200
            text, lines = [], []
            async for line in r.aiter_lines():
                lines.append(line)
                if job["drop"] and len(lines) >= 3:
                    return None  # hang up mid-stream
            for c in sse(lines):
                text.append(c["choices"][0]["text"])
            return "".join(text), c["choices"][0]["finish_reason"]

    async def all_jobs():
        limits = httpx.Limits(max_connections=256)
        async with httpx.AsyncClient(timeout=300, limits=limits) as client:
            return await asyncio.gather(*(one(client, j) for j in jobs))

    results = asyncio.run(all_jobs())
    for job, res in zip(jobs, results, strict=True):
        if job["drop"]:
            assert res is None
            continue
        text, reason = res
        assert reason == "length"
        if job["temperature"] == 0:
            assert text == alone_text(alone, tok, job["prompt"], job["max_tokens"])
    deadline = time.time() + 30
    while not engine.idle() and time.time() < deadline:  # dropped streams are cancelled, their rows freed
        time.sleep(0.05)
    assert engine.idle() and sorted(engine._free) == [0, 1, 2, 3]
    metrics = httpx.get(f"{url}/metrics", headers=AUTH).text
    assert "linnet_rows_in_use 0" in metrics and "linnet_time_to_first_token_seconds_count" in metrics


BAD = [
    (b"not json", 400, "not valid JSON"),
    (b'"a string"', 400, "JSON object"),
    (b"[1, 2]", 400, "JSON object"),
    (b"42", 400, "JSON object"),
    (json.dumps({"prompt": 5}).encode(), 400, "'prompt'"),
    (json.dumps({"prompt": "x", "max_tokens": "ten"}).encode(), 400, "'max_tokens' must be an integer"),
    (json.dumps({"prompt": "x", "max_tokens": 0}).encode(), 400, "'max_tokens' must be >= 1"),
    (json.dumps({"prompt": "x", "max_tokens": 100000}).encode(), 400, "'max_tokens' must be <="),
    (json.dumps({"prompt": "x " * 120, "max_tokens": 100}).encode(), 400, "a cache row holds"),
    (json.dumps({"prompt": "x", "temperature": -1}).encode(), 400, "'temperature' must be >= 0"),
    (json.dumps({"prompt": "x", "top_p": 0}).encode(), 400, "'top_p' must be > 0"),
    (json.dumps({"prompt": "x", "model": "gpt-4"}).encode(), 404, "does not exist"),
    (json.dumps({"prompt": "x", "stop": 3}).encode(), 400, "'stop'"),
    (json.dumps({"prompt": "x", "stream": "yes"}).encode(), 400, "'stream'"),
    (json.dumps({"prompt": [1, 99999]}).encode(), 400, "token ids must be in"),
    (b'{"prompt": "' + b"x" * 70000 + b'"}', 413, "the limit is"),
]


@pytest.mark.parametrize("raw,status,text", BAD)
def test_bad_bodies_get_openai_errors(served, raw, status, text):
    url = served[0]
    r = httpx.post(f"{url}/v1/completions", headers={**AUTH, "Content-Type": "application/json"}, content=raw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert text in err["message"] and set(err) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("messages,text", [([], "non-empty list"), ("hi", "non-empty list"),
                                           ([{"content": "x"}], "'role'"), ([{"role": "user", "content": 5}], "string")])
def test_bad_chat_messages(served, messages, text):
    r = httpx.post(f"{served[0]}/v1/chat/completions", headers=AUTH, json={"messages": messages})
    assert r.status_code == 400 and text in r.json()["error"]["message"]


def test_api_key(served):
    url = served[0]
    assert httpx.get(f"{url}/health").status_code == 200  # open
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.post(f"{url}/v1/completions", headers=headers, json={"prompt": "x"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{url}/metrics").status_code == 401
    assert httpx.get(f"{url}/nope", headers=AUTH).status_code == 404


def test_sigterm_drains_and_exits(tokenized_checkpoints, tmp_path):
    """A real `linnet serve` process: SIGTERM under load lets requests in flight finish, then exits."""
    port = free_port()
    env = {**os.environ, "LINNET_CACHE": str(tmp_path / "c")}
    proc = subprocess.Popen([sys.executable, "-m", "linnet_cli", "serve", str(tokenized_checkpoints[CASE]),
                             "--port", str(port), "--rows", "2", "--cache-len", "96", "--drain-timeout", "20"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        assert wait_healthy(url), proc.stderr.read() if proc.poll() is not None else "no answer"
        results = []

        def request():
            r = httpx.post(f"{url}/v1/completions", json={"prompt": "The list", "max_tokens": 60,
                                                           "ignore_eos": True, "temperature": 0}, timeout=60)
            results.append(r.json()["choices"][0]["finish_reason"] if r.status_code == 200 else r.status_code)

        threads = [threading.Thread(target=request) for _ in range(4)]
        for t in threads:
            t.start()
        time.sleep(0.3)
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(timeout=60)
        # uvicorn re-raises the signal once it has shut down, so the status says "ended by SIGTERM".
        assert proc.wait(timeout=60) in (0, -signal.SIGTERM)
        assert results == ["length"] * 4  # in flight when SIGTERM came: all finished
        with pytest.raises(httpx.HTTPError):  # and nothing listens any more
            httpx.get(f"{url}/health", timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize("case", ["qwen3moe-experts", "mixtral-experts"])
def test_mixtures_of_experts_serve(case, tokenized_checkpoints):
    """Concurrent rows choose different experts in each step (one ragged call over all their tokens) and
    all finish; a chat through the model's template answers, token for token (logprobs' bytes), as the
    model alone does. (Rows batched together match their lone answers only to float32 rounding, dense
    models' too; the text of random bytes is compared by bytes, as a stream's decoding may differ.)"""
    path = tokenized_checkpoints[case]
    session, _ = load_model(path, "torch", "float32", CACHE, rows=4)
    alone, _ = load_model(path, "torch", "float32", CACHE, rows=1)
    tok = Tokenizer(path)
    engine = Engine(session, tok, prefill_chunk=32, max_waiting=64)
    app = create_app(Server(engine, tok, "moe", Limits(max_tokens=CACHE, max_body_bytes=64 * 1024)))
    prompts = ["The list object", "A tuple is", "Dictionaries map keys", "Sets hold"]
    bodies: dict[str, dict] = {}
    messages = [{"role": "user", "content": "Hello"}]
    with app_in_thread(app) as url:
        chat = httpx.post(f"{url}/v1/chat/completions", json={  # first: later ones reuse the prefix cache
            "messages": messages, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "logprobs": True},
            timeout=120).json()["choices"][0]

        def ask(prompt: str) -> None:
            bodies[prompt] = httpx.post(f"{url}/v1/completions", json={
                "model": "moe", "prompt": prompt, "max_tokens": 10, "temperature": 0, "ignore_eos": True},
                timeout=120).json()

        threads = [threading.Thread(target=ask, args=(p,)) for p in prompts]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert all(bodies[p]["usage"]["completion_tokens"] == 10 for p in prompts), bodies
    served = [bytes(c["bytes"]) for c in chat["logprobs"]["content"]]
    assert served == [tok.token_bytes(t) for t in Generation(alone, tok.apply_chat_template(messages), 8)]
