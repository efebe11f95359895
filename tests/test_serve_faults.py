"""Serving under faults, hostile input and disconnects (issue 18): one bad request never takes the
engine down, bad numbers are 400s, metrics stay bounded, clients that leave are cancelled."""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import time

import pytest

httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")

from linnet_core.compile import load_model  # noqa: E402
from linnet_core.runtime.generate import Generation  # noqa: E402
from linnet_core.runtime.sampling import Sampler, SamplingParams  # noqa: E402
from linnet_core.serve.engine import Engine, EngineUnavailable, GenerationRequest  # noqa: E402
from linnet_core.serve.http import Limits, Server, create_app  # noqa: E402
from linnet_core.serve.metrics import Histogram  # noqa: E402
from linnet_core.tokenizer import Tokenizer  # noqa: E402
from server_fixtures import app_in_thread  # noqa: E402

CASE = "qwen2-bias-tied"
CACHE = 128
KEY = "sk-fault-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def sessions(tokenized_checkpoints):
    path = tokenized_checkpoints[CASE]
    session, _ = load_model(path, "torch", "float32", CACHE, rows=4)
    alone, _ = load_model(path, "torch", "float32", CACHE, rows=1)
    return session, alone, Tokenizer(path)


def serving(engine, tok, limits=Limits(max_tokens=CACHE, max_body_bytes=16 * 1024, max_prompt_chars=4000)):
    return app_in_thread(create_app(Server(engine, tok, "tiny", limits), api_key=KEY))


@pytest.fixture(scope="module")
def served(sessions):
    session, alone, tok = sessions
    engine = Engine(session, tok, prefill_chunk=32, max_waiting=64)
    with serving(engine, tok) as url:
        yield url, engine, alone, tok


def alone_ids(alone, prompt, n, sampling=None):
    return list(Generation(alone, prompt, n, sampler=Sampler(sampling) if sampling else None))


BAD = [
    (b'{"prompt": "x", "temperature": NaN}', "NaN is not a JSON number", None),
    (b'{"prompt": "x", "top_p": Infinity}', "Infinity is not a JSON number", None),
    (b'{"prompt": "x", "temperature": -Infinity}', "-Infinity", None),
    (b'{"prompt": "x", "temperature": 1e999}', "finite", "temperature"),
    (b'{"prompt": "x", "seed": 18446744073709551616}', "'seed' must be <=", "seed"),
    (b'{"prompt": "x", "seed": -9223372036854775809}', "'seed' must be >=", "seed"),
    (b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", "integer too long", None),
    (b'{"prompt": "x", "max_tokens": ' + b"9" * 3000 + b"}", "...(3000 digits)", "max_tokens"),
    (b'{"prompt": "x", "a": ' + b"[" * 5000 + b"]" * 5000 + b"}", "nests too deeply", None),
    (json.dumps({"prompt": "x", "stop": [1]}).encode(), "'stop'", "stop"),
    (json.dumps({"prompt": "x", "stop": ["a"] * 17}).encode(), "at most 16", "stop"),
    (json.dumps({"prompt": "x", "stop": ["a" * 300]}).encode(), "256 characters", "stop"),
    (json.dumps({"prompt": "x", "stop_token_ids": ["a"]}).encode(), "'stop_token_ids'", "stop_token_ids"),
    (json.dumps({"prompt": "x", "stop_token_ids": [10 ** 9]}).encode(), "token ids in", "stop_token_ids"),
    (json.dumps({"prompt": "x", "top_k": 10 ** 20}).encode(), "'top_k' must be <=", "top_k"),
    (json.dumps({"prompt": "x", "ignore_eos": "yes"}).encode(), "'ignore_eos'", "ignore_eos"),
    (json.dumps({"prompt": "x", "n": 0}).encode(), "'n' must be >= 1", "n"),
    (json.dumps({"prompt": "x", "logprobs": 21}).encode(), "'logprobs' must be <= 20", "logprobs"),
    (json.dumps({"prompt": "x", "logit_bias": {"x5": 10}}).encode(), "'logit_bias' keys", "logit_bias"),
    (json.dumps({"prompt": "x", "presence_penalty": 2.5}).encode(), "'presence_penalty' must be <=", "presence_penalty"),
    (json.dumps({"prompt": "x", "frequency_penalty": "1"}).encode(), "'frequency_penalty'", "frequency_penalty"),
    (json.dumps({"prompt": "x", "suffix": "y"}).encode(), "'suffix' is not supported", "suffix"),
    (json.dumps({"prompt": "x", "tools": [{"type": "function"}]}).encode(), "'tools'", "tools"),
    (json.dumps({"prompt": "x" * 4001}).encode(), "the limit is 4000", "prompt"),
    (json.dumps({"prompt": ["a"] * 65}).encode(), "the limit is 64", "prompt"),
]


@pytest.mark.parametrize("raw,text,param", BAD)
def test_bad_numbers_and_fields_are_400s_naming_the_field(served, raw, text, param):
    r = httpx.post(f"{served[0]}/v1/completions", headers={**AUTH, "Content-Type": "application/json"}, content=raw)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert text in err["message"] and err["param"] == param and "/" not in err["message"]


def test_neutral_values_of_unsupported_fields_pass(served):
    url, engine, alone, tok = served
    r = httpx.post(f"{url}/v1/completions", headers=AUTH, json={
        "prompt": "The list", "max_tokens": 3, "temperature": 0, "n": 1, "logprobs": None, "logit_bias": {},
        "presence_penalty": 0, "frequency_penalty": 0.0, "echo": False, "ignore_eos": True})
    assert r.status_code == 200, r.text


def test_a_tiny_temperature_samples_like_greedy_not_nan(served):
    url, engine, alone, tok = served
    prompt = tok.encode("The list object")
    r = httpx.post(f"{url}/v1/completions", headers=AUTH, json={
        "prompt": prompt, "max_tokens": 6, "temperature": 1e-300, "seed": 3, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == tok.decode(alone_ids(alone, prompt, 6))


def test_body_limits_before_and_while_reading(served):
    url = served[0]
    port = int(url.rsplit(":", 1)[1])
    # a Content-Length over the limit is refused before the body is sent
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() +
                  b"\r\nContent-Type: application/json\r\nContent-Length: 100000000\r\n\r\n")
        head = s.recv(4096).decode()
    assert head.startswith("HTTP/1.1 413"), head

    def chunks():  # chunked, no length: counted as it arrives
        for _ in range(40):
            yield b" " * 1024
    r = httpx.post(f"{url}/v1/completions", headers={**AUTH, "Content-Type": "application/json"}, content=chunks())
    assert r.status_code == 413 and "the limit is" in r.json()["error"]["message"]


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", "application/jsonx"])
def test_a_body_not_declared_json_is_refused(served, content_type):
    """What a browser may send cross-site without a preflight (or no type at all) is a 415: a web page
    cannot make a keyless local server compute."""
    headers = {**AUTH, **({"Content-Type": content_type} if content_type else {})}
    r = httpx.post(f"{served[0]}/v1/completions", headers=headers, content=json.dumps({"prompt": "x", "max_tokens": 1}))
    assert r.status_code == 415 and "Content-Type: application/json" in r.json()["error"]["message"]
    for ok in ("application/json; charset=utf-8", "Application/JSON", "application/vnd.api+json"):
        r = httpx.post(f"{served[0]}/v1/completions", headers={**AUTH, "Content-Type": ok},
                       content=json.dumps({"prompt": "x", "max_tokens": 1}))
        assert r.status_code == 200, (ok, r.text)


def test_a_batch_of_prompts_gets_one_choice_each(served):
    url, engine, alone, tok = served
    prompts = ["The list object", "Hello there", "A"]
    r = httpx.post(f"{url}/v1/completions", headers=AUTH, json={
        "prompt": prompts, "max_tokens": 5, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    for p, c in zip(prompts, body["choices"], strict=True):
        assert c["text"] == tok.decode(alone_ids(alone, tok.encode(p), 5)) and c["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 15
    with httpx.stream("POST", f"{url}/v1/completions", headers=AUTH, json={
            "prompt": prompts, "max_tokens": 5, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}) as s:
        *events, usage = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    streamed = {i: "".join(e["choices"][0]["text"] for e in events if e["choices"][0]["index"] == i) for i in range(3)}
    assert [streamed[i] for i in range(3)] == [c["text"] for c in body["choices"]]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 15


def test_chat_default_max_tokens_is_the_rest_of_the_context(served):
    url, engine, alone, tok = served
    messages = [{"role": "user", "content": "Hi"}]
    r = httpx.post(f"{url}/v1/chat/completions", headers=AUTH, json={
        "messages": messages, "temperature": 0, "ignore_eos": True}, timeout=120)
    assert r.status_code == 200, r.text
    used = r.json()["usage"]
    assert used["completion_tokens"] == CACHE - len(tok.apply_chat_template(messages))


def wait_idle(engine, seconds=20):
    deadline = time.time() + seconds
    while not engine.idle() and time.time() < deadline:
        time.sleep(0.02)
    return engine.idle()


def test_a_client_that_leaves_a_plain_request_is_cancelled(served):
    url, engine, alone, tok = served
    before = engine.metrics.finished_by_reason.get("cancelled", 0)

    async def leave():
        async with httpx.AsyncClient(timeout=30) as client:
            task = asyncio.ensure_future(client.post(f"{url}/v1/completions", headers=AUTH, json={
                "prompt": "The list", "max_tokens": 120, "ignore_eos": True, "temperature": 0}))
            deadline = time.time() + 20
            while engine.running == 0 and time.time() < deadline:
                await asyncio.sleep(0.01)
            task.cancel()  # the connection closes under the request
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(leave())
    assert wait_idle(engine, 10)  # freed well before its 120 tokens could have run
    assert engine.metrics.finished_by_reason.get("cancelled", 0) == before + 1


def test_histograms_stay_the_same_size():
    h = Histogram()
    for i in range(200_000):
        h.observe((i % 1000) / 100)
    assert len(h.counts) == 12 and h.count == 200_000
    lines = h.render("x", "X.")
    assert lines[-1] == "x_count 200000" and 'x_bucket{le="+Inf"} 200000' in lines


# -- the engine's own guards, without HTTP ---------------------------------------------------------

def test_a_request_whose_output_fails_ends_alone(sessions):
    session, alone, tok = sessions
    engine = Engine(session, tok, prefill_chunk=32).start()
    try:
        emit = engine._emit
        poisoned = set()

        def faulty(a, token, *rest):
            if a.handle.id in poisoned:
                raise RuntimeError("injected")
            emit(a, token, *rest)

        engine._emit = faulty
        prompts = [tok.encode(t) for t in ("The list object", "Hello there", "Why not")]
        handles = [engine.submit(GenerationRequest(p, 8, ignore_eos=True)) for p in prompts]
        bad = engine.submit(GenerationRequest(prompts[0], 8, ignore_eos=True))
        poisoned.add(bad.id)
        results = [h.result() for h in handles]
        assert bad.result()[2] == "error"
        for p, (text, ids, reason) in zip(prompts, results, strict=True):
            assert reason == "length" and ids == alone_ids(alone, p, 8)
        assert engine.healthy and wait_idle(engine)
        assert sorted(engine._free) == [0, 1, 2, 3]
    finally:
        engine.stop(timeout=5)


def test_a_failing_step_does_not_move_other_rows_seeded_streams(sessions):
    """A step that fails is rerun row by row; the rows that already sampled draw the same again."""
    session, alone, tok = sessions
    engine = Engine(session, tok, prefill_chunk=32)
    step = session.step_tokens
    fail_slots = set()

    def flaky(chunks):
        if any(c.slot in fail_slots for c in chunks):
            raise RuntimeError("injected step fault")
        return step(chunks)

    prompts = [tok.encode(t) for t in ("The list object", "Hello there")]
    sampling = SamplingParams(temperature=0.9, top_p=0.95, seed=11)
    handles = [engine.submit(GenerationRequest(p, 10, sampling, ignore_eos=True)) for p in prompts]
    bad = engine.submit(GenerationRequest(prompts[0], 10, sampling, ignore_eos=True))
    session.step_tokens = flaky
    try:
        for i in range(30):
            if i == 3:  # the third request's row fails from its fourth step on
                fail_slots.add(next(row for row, a in engine._active.items() if a.handle is bad))
            if not engine.step():
                break
    finally:
        session.step_tokens = step
    assert bad.result()[2] == "error"
    for p, h in zip(prompts, handles, strict=True):
        assert h.result()[1] == alone_ids(alone, p, 10, sampling)


def test_a_broken_scheduler_ends_every_request_and_reports_unhealthy(sessions):
    session, alone, tok = sessions
    engine = Engine(session, tok, prefill_chunk=32)
    with serving(engine, tok) as url:
        assert httpx.get(f"{url}/health").status_code == 200
        engine._prompt_chunks = lambda budget: (_ for _ in ()).throw(RuntimeError("scheduler bug"))
        r = httpx.post(f"{url}/v1/completions", headers=AUTH, json={"prompt": "The list", "max_tokens": 4},
                       timeout=30)
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "error"
        health = httpx.get(f"{url}/health")
        assert health.status_code == 503 and health.json()["status"] == "unhealthy"
        again = httpx.post(f"{url}/v1/completions", headers=AUTH, json={"prompt": "The list"})
        assert again.status_code == 503 and again.headers["retry-after"]
        assert "linnet_engine_healthy 0" in httpx.get(f"{url}/metrics", headers=AUTH).text
        with pytest.raises(EngineUnavailable):
            engine.submit(GenerationRequest(tok.encode("x"), 2))


def test_shutting_down_answers_503_with_retry_after(sessions):
    session, alone, tok = sessions
    engine = Engine(session, tok, prefill_chunk=32)
    with serving(engine, tok) as url:
        engine.stop(timeout=1)
        r = httpx.post(f"{url}/v1/completions", headers=AUTH, json={"prompt": "The list"})
        assert r.status_code == 503 and r.headers["retry-after"] and "shutting down" in r.json()["error"]["message"]
        assert httpx.get(f"{url}/health").status_code == 503


def test_malformed_requests_are_refused_where_they_are_built():
    for bad in ({"stop": [1]}, {"stop": "x"}, {"stop_token_ids": ["a"]}, {"max_tokens": True}):
        kwargs = {"prompt": [1], "max_tokens": 2, **bad}
        with pytest.raises(Exception) as e:
            GenerationRequest(**kwargs)
        assert type(e.value).__name__ == "InputError"


def test_a_watched_request_whose_client_left_is_dropped_before_its_prefill(sessions):
    """Triton's face: a queued request sends nothing through which a departure would show, so the
    engine asks the face's probe while the request waits, and drops it before any prefill."""
    session, alone, tok = sessions
    engine = Engine(session, tok, prefill_chunk=32)
    busy = [engine.submit(GenerationRequest(tok.encode("Once"), 40, ignore_eos=True)) for _ in range(4)]
    gone = {"now": False}
    queued = engine.submit(GenerationRequest(tok.encode("The list"), 40, ignore_eos=True))
    queued.watch(lambda: gone["now"])
    for _ in range(3):
        engine.step()
    assert queued not in [a.handle for a in engine._active.values()]  # all 4 rows are busy
    gone["now"] = True
    time.sleep(0.06)  # the probe is asked at most every 50 ms
    engine.step()
    assert queued.get(timeout=1).finish_reason == "cancelled" and queued.stats.first_token is None
    while not engine.idle():
        engine.step()
    assert all(h.result()[2] == "length" for h in busy)


def test_the_official_openai_client(served):
    """What a user of the `openai` package does, unchanged: completions (one prompt and a batch),
    chat, streaming, and a refused feature as the client's BadRequestError naming the field."""
    openai = pytest.importorskip("openai")
    url, engine, alone, tok = served
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in client.models.list()] == ["tiny"]
    one = client.completions.create(model="tiny", prompt="The list object", max_tokens=5, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert one.choices[0].text == tok.decode(alone_ids(alone, tok.encode("The list object"), 5))
    batch = client.completions.create(model="tiny", prompt=["The list object", "Hello"], max_tokens=5,
                                      temperature=0, extra_body={"ignore_eos": True})
    assert [c.index for c in batch.choices] == [0, 1] and batch.choices[0].text == one.choices[0].text
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                          temperature=0, extra_body={"ignore_eos": True})
    ids = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert chat.choices[0].message.content == tok.decode(alone_ids(alone, ids, 4))
    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                            temperature=0, stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == chat.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="x", suffix="y")
    assert e.value.body["param"] == "suffix"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()


def test_triton_model_readiness_follows_the_engine(tokenized_checkpoints, tmp_path, monkeypatch):
    """The Triton model's `is_ready` (asked by Python backends from 26.03 on; the tritonserver the tests
    run predates it) is the engine's health: false once a fault has stopped the engine."""
    import importlib
    import types

    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", types.ModuleType("triton_python_backend_utils"))
    monkeypatch.setenv("LINNET_CACHE", str(tmp_path / "cache"))
    triton_model = importlib.import_module("linnet_core.serve.triton_model")
    params = {"linnet_model": str(tokenized_checkpoints[CASE]), "linnet_backend": "torch",
              "linnet_dtype": "float32", "linnet_rows": "2", "linnet_cache_len": "64"}
    model = triton_model.TritonPythonModel()
    model.initialize({"model_config": json.dumps({"parameters": {k: {"string_value": v} for k, v in params.items()}})})
    try:
        assert model.is_ready()
        model.engine._fail(RuntimeError("injected"))
        assert not model.is_ready()
    finally:
        model.finalize()
