"""`linnet export triton`, served by a REAL Triton Inference Server (the `tritonserver` binary that the
`nvidia-pytriton` wheel ships, on CPU with its Python backend): streaming, non-streaming, cancellation.

The server needs its own Python environment (EXECUTION_ENV_PATH) with numpy < 2, or the backend
stub crashes on string inputs; nvidia-pytriton itself pins numpy < 2, so it cannot join the test
extra. The fixture builds both once under ~/.cache/linnet-tests/triton (pip, from the package
index), and the tests skip, saying why, where that cannot be done.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
from family_fixtures import needs_kernels  # noqa: E402

from linnet_core.backends.cpu import extension  # noqa: E402

HOME = Path(os.environ.get("LINNET_TRITON_HOME", Path.home() / ".cache" / "linnet-tests" / "triton"))
CASE = "qwen2-bias-tied"


class Served(tuple):
    """(HTTP url, checkpoint, log), and the gRPC port."""

    def __new__(cls, items, grpc_port: int):
        self = super().__new__(cls, items)
        self.grpc_port = grpc_port
        return self


@pytest.fixture(scope="module")
def triton(tokenized_checkpoints, tmp_path_factory):
    from linnet_core.errors import InputError
    from linnet_core.serve import free_port
    from linnet_core.serve.config import ServeConfig
    from linnet_core.serve.triton import export_triton, launch_local_triton, prepare_local_triton

    try:
        server, env = prepare_local_triton(HOME)
    except InputError as e:
        pytest.skip(e.message)
    repo = tmp_path_factory.mktemp("triton") / "repo"
    # the fixture's whole context (256), so a client that hangs up does so long before its request could end
    export_triton(tokenized_checkpoints[CASE], repo, ServeConfig(dtype="float32", rows=4, cache_len=256), name="tiny",
                  env=env)
    if extension.extension() is not None:  # a second model of the same repository: 4-bit weights
        quantized = repo.parent / "quantized"
        export_triton(tokenized_checkpoints[CASE], quantized, ServeConfig(dtype="q4_0", rows=4, cache_len=96),
                      name="tiny-q4", env=env)
        (quantized / "tiny-q4").rename(repo / "tiny-q4")
    port, grpc_port = free_port(), free_port()
    log = repo.parent / "triton.log"
    proc = launch_local_triton(repo, server, port, log, grpc_port=grpc_port)
    yield Served((f"http://127.0.0.1:{port}", tokenized_checkpoints[CASE], log), grpc_port=grpc_port)
    proc.terminate()
    proc.wait(timeout=60)


def _alone(path, prompt: str, n: int, dtype: str = "float32") -> str:
    from linnet_core.compile import load_model
    from linnet_core.runtime.generate import Generation
    from linnet_core.tokenizer import Tokenizer

    session, _ = load_model(path, "torch", dtype, 96, rows=1)
    tok = Tokenizer(path)
    return tok.decode(list(Generation(session, tok.encode(prompt), n)))


def test_streaming_and_not(triton):
    url, path, _ = triton
    body = {"text_input": "The list object", "max_tokens": 8, "sampling_parameters": json.dumps({"ignore_eos": True})}
    with httpx.stream("POST", f"{url}/v2/models/tiny/generate_stream", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert len(events) == 9 and events[-1]["finish_reason"] == "length"  # a delta per token, then the end
    streamed = "".join(e["text_output"] for e in events)
    whole = httpx.post(f"{url}/v2/models/tiny/generate", json={**body, "stream": False}, timeout=60).json()
    assert whole["finish_reason"] == "length" and whole["text_output"] == streamed
    assert streamed == _alone(path, "The list object", 8)  # the same engine, the same greedy answer


@needs_kernels
def test_a_quantized_artifact_serves_the_same_answer(triton):
    url, path, _ = triton
    body = {"text_input": "The list object", "max_tokens": 8, "stream": False,
            "sampling_parameters": json.dumps({"ignore_eos": True})}
    whole = httpx.post(f"{url}/v2/models/tiny-q4/generate", json=body, timeout=60).json()
    assert whole["finish_reason"] == "length" and whole["text_output"] == _alone(path, "The list object", 8, "q4_0")


def test_a_client_that_leaves_is_cancelled(triton):
    url, _, log = triton
    body = {"text_input": "Once", "max_tokens": 240, "stream": True,
            "sampling_parameters": json.dumps({"ignore_eos": True})}
    with httpx.stream("POST", f"{url}/v2/models/tiny/generate_stream", json=body, timeout=60) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i >= 4:
                break  # hang up after a few tokens
    deadline = time.time() + 30
    while "cancelled by its client" not in log.read_text() and time.time() < deadline:
        time.sleep(0.1)
    assert "cancelled by its client" in log.read_text()
    # The server goes on serving.
    for _ in range(6):
        r = httpx.post(f"{url}/v2/models/tiny/generate",
                       json={"text_input": "Hi", "max_tokens": 4, "stream": False,
                             "sampling_parameters": json.dumps({"ignore_eos": True})}, timeout=60)
        assert r.status_code == 200 and r.json()["finish_reason"] == "length"


def test_bad_requests_are_errors_not_crashes(triton):
    url, _, _ = triton
    r = httpx.post(f"{url}/v2/models/tiny/generate", json={"text_input": "x", "max_tokens": 0, "stream": False},
                   timeout=60)
    assert r.status_code >= 400 and "max_tokens" in r.text
    assert httpx.get(f"{url}/v2/health/ready").status_code == 200


def _post(url, text, sampling, max_tokens=4, stream=False, model="tiny"):
    body = {"text_input": text, "max_tokens": max_tokens, "stream": stream,
            "sampling_parameters": sampling if isinstance(sampling, str) else json.dumps(sampling)}
    return httpx.post(f"{url}/v2/models/{model}/generate", json=body, timeout=60)


@pytest.mark.parametrize("sampling,text", [
    ({"stop": [1]}, "'stop'"),  # once reached str.find in the engine's thread and killed it
    ({"stop_token_ids": ["a"]}, "'stop_token_ids'"),
    ('{"temperature": NaN}', "NaN is not a JSON number"),
    ({"seed": 2 ** 70}, "'seed' must be <="),
    ({"n": 2}, "'n' is not supported"),
    ({"logprobs": 2}, "'logprobs' is not supported"),  # generate answers one text: nothing to carry them
    ({"temperature": "hot"}, "'temperature' must be a number"),
    ('{"a": ' + "[" * 3000 + "]" * 3000 + "}", "nests too deeply"),
    ("[1, 2]", "must be a JSON object"),
])
def test_bad_sampling_parameters_are_errors_and_the_engine_lives_on(triton, sampling, text):
    url, path, _ = triton
    r = _post(url, "The list", sampling)
    assert r.status_code >= 400 and text in r.text, r.text
    ok = _post(url, "The list object", {"ignore_eos": True}, max_tokens=6)
    assert ok.status_code == 200 and ok.json()["text_output"] == _alone(path, "The list object", 6)
    assert httpx.get(f"{url}/v2/models/tiny/ready").status_code == 200


def test_the_openai_faces_sampling_fields_hold_here_too(triton):
    """One implementation behind both faces: penalties and bias through `sampling_parameters` change
    the answer as they do on `linnet serve`."""
    from linnet_core.tokenizer import Tokenizer

    url, path, _ = triton
    forced = Tokenizer(path).encode(" x", add_special_tokens=False)[-1]
    biased = _post(url, "The list object", {"logit_bias": {str(forced): 100}, "ignore_eos": True}, max_tokens=4)
    assert biased.status_code == 200 and biased.json()["text_output"] == Tokenizer(path).decode([forced] * 4)
    penalised = _post(url, "The list object", {"repetition_penalty": 5.0, "presence_penalty": 2, "ignore_eos": True},
                      max_tokens=8)
    assert penalised.status_code == 200


def test_structured_output_through_sampling_parameters(triton):
    url, path, _ = triton
    r = _post(url, "The list", {"guided_choice": ["alpha", "beta gamma"], "temperature": 0}, max_tokens=20)
    if r.status_code == 400 and "structured output is unavailable here" in r.text:
        # the local PyTriton stub's Python is an older 3.11 than this one: xgrammar's imports (ssl) fail in it
        pytest.skip(r.json()["error"])
    assert r.status_code == 200 and r.json()["text_output"] in ("alpha", "beta gamma"), r.text
    r = _post(url, "The list", {"guided_json": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}},
              max_tokens=40)
    assert r.status_code == 200 and all(isinstance(v, bool) for v in json.loads(r.json()["text_output"])), r.text
    r = _post(url, "The list", {"guided_regex": "(["})
    assert r.status_code >= 400 and "'guided_regex'" in r.text


def test_a_smaller_soak_with_drops_and_bad_requests(triton):
    """80 requests at 8 in flight over the 4 rows: 30% of clients leave mid-stream, 10% send bad
    sampling parameters; the rest get the answer each gets alone; queued ones that left never ran."""
    import asyncio
    import random

    url, path, log = triton
    rng = random.Random(7)
    texts = ["The list object", "Hello there", "Why", "Once upon a time"]
    alone = {(t, n): _alone(path, t, n) for t in texts for n in (3, 9)}
    jobs = []
    for _ in range(80):
        roll = rng.random()
        jobs.append({"kind": "bad" if roll < 0.1 else "leave" if roll < 0.4 else "whole",
                     "text": rng.choice(texts), "n": rng.choice((3, 9))})

    async def one(client, sem, job):
        async with sem:
            sampling = {"stop": [7]} if job["kind"] == "bad" else {"ignore_eos": True}
            body = {"text_input": job["text"], "max_tokens": 240 if job["kind"] == "leave" else job["n"],
                    "stream": True, "sampling_parameters": json.dumps(sampling)}
            async with client.stream("POST", f"{url}/v2/models/tiny/generate_stream", json=body) as r:
                if job["kind"] == "bad":
                    await r.aread()
                    return r.status_code, None
                parts = []
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    event = json.loads(line[6:])
                    parts.append(event.get("text_output", ""))
                    if job["kind"] == "leave" and len(parts) >= 2:
                        return r.status_code, None  # hang up
                return r.status_code, "".join(parts)

    async def run():
        sem = asyncio.Semaphore(8)
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(one(client, sem, j) for j in jobs))

    results = asyncio.run(run())
    for job, (status, text) in zip(jobs, results, strict=True):
        if job["kind"] == "bad":
            assert status >= 400
        elif job["kind"] == "whole":
            assert status == 200 and text == alone[(job["text"], job["n"])], job
    deadline = time.time() + 30
    while log.read_text().count("cancelled by its client") < sum(j["kind"] == "leave" for j in jobs) \
            and time.time() < deadline:
        time.sleep(0.2)
    assert log.read_text().count("cancelled by its client") >= sum(j["kind"] == "leave" for j in jobs)
    assert httpx.get(f"{url}/v2/models/tiny/ready").status_code == 200



@pytest.fixture(scope="module")
def grpc_client_site():
    """tritonclient[grpc] installed apart (pip --target, as the server is): its protobuf pin must not
    meet the test environment's. Skips, saying why, where pip cannot fetch it."""
    import subprocess
    import sys

    site = HOME / "client"
    if not (site / "tritonclient").is_dir():
        try:
            subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--target", str(site),
                            "tritonclient[grpc]"], check=True, capture_output=True, timeout=900)
        except (subprocess.SubprocessError, OSError) as e:
            pytest.skip(f"cannot install tritonclient[grpc] for the gRPC client: {e}")
    return site


GRPC_CLIENT = """
import sys, time
import numpy as np
import tritonclient.grpc as grpcclient

port, n_busy, n_left = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])

def inputs(text, max_tokens):
    values = [("text_input", np.array([text.encode()], dtype=np.object_), "BYTES"),
              ("max_tokens", np.array([max_tokens], dtype=np.int32), "INT32"),
              ("stream", np.array([True]), "BOOL"),
              ("sampling_parameters", np.array([b'{"ignore_eos": true}'], dtype=np.object_), "BYTES")]
    out = []
    for name, value, kind in values:
        t = grpcclient.InferInput(name, list(value.shape), kind)
        t.set_data_from_numpy(value)
        out.append(t)
    return out

finals = []
def on_busy(result, error):
    if error is None and result.as_numpy("finish_reason")[0]:
        finals.append(1)

busy = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")


def handed_to_the_model():  # requests whose execute() has returned: in the engine's hands from then on
    stats = busy.get_inference_statistics("tiny", as_json=True)["model_stats"][0]["inference_stats"]
    return int(stats["success"].get("count", 0))


def wait_until_handed(count):  # a request cancelled before Triton hands it over never reaches the engine
    deadline = time.time() + 30
    while handed_to_the_model() < count and time.time() < deadline:
        time.sleep(0.01)


start = handed_to_the_model()
busy.start_stream(callback=on_busy)
for i in range(n_busy):
    busy.async_stream_infer("tiny", inputs("Once", 90), request_id=f"busy-{i}")
wait_until_handed(start + n_busy)
left = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
left.start_stream(callback=lambda result, error: None)
for i in range(n_left):
    left.async_stream_infer("tiny", inputs("The list", 50), request_id=f"left-{i}")
wait_until_handed(start + n_busy + n_left)
left.stop_stream(cancel_requests=True)  # the client leaves while its requests wait for rows
deadline = time.time() + 120
while len(finals) < n_busy and time.time() < deadline:
    time.sleep(0.05)
busy.stop_stream()
print(len(finals))
"""


def test_a_queued_request_cancelled_over_grpc_never_runs(triton, grpc_client_site):
    """Rows busy with long answers; a gRPC client's requests queued behind them, then cancelled: the
    engine asks Triton's is_cancelled while they wait and drops them before their prefill."""
    import subprocess
    import sys

    url, _, log = triton
    before = log.read_text().count("before its prefill")
    env = {**os.environ, "PYTHONPATH": str(grpc_client_site)}
    r = subprocess.run([sys.executable, "-c", GRPC_CLIENT, str(triton.grpc_port), "16", "3"], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "16", r.stderr[-3000:]
    deadline = time.time() + 30
    while log.read_text().count("before its prefill") < before + 3 and time.time() < deadline:
        time.sleep(0.2)
    assert log.read_text().count("before its prefill") == before + 3, log.read_text()[-3000:]
