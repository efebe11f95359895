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

HOME = Path(os.environ.get("LINNET_TRITON_HOME", Path.home() / ".cache" / "linnet-tests" / "triton"))
CASE = "qwen2-bias-tied"


@pytest.fixture(scope="module")
def triton(tokenized_checkpoints, tmp_path_factory):
    from linnet_core.errors import InputError
    from linnet_core.serve import free_port
    from linnet_core.serve.triton import export_triton, launch_local_triton, prepare_local_triton

    try:
        server, env = prepare_local_triton(HOME)
    except InputError as e:
        pytest.skip(e.message)
    repo = tmp_path_factory.mktemp("triton") / "repo"
    export_triton(tokenized_checkpoints[CASE], repo, "torch", "float32", rows=4, cache_len=96, name="tiny", env=env)
    quantized = repo.parent / "quantized"  # a second model of the same repository: 4-bit weights
    export_triton(tokenized_checkpoints[CASE], quantized, "torch", "q4_0", rows=4, cache_len=96, name="tiny-q4", env=env)
    (quantized / "tiny-q4").rename(repo / "tiny-q4")
    port = free_port()
    log = repo.parent / "triton.log"
    proc = launch_local_triton(repo, server, port, log)
    yield f"http://127.0.0.1:{port}", tokenized_checkpoints[CASE], log
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


def test_a_quantized_artifact_serves_the_same_answer(triton):
    url, path, _ = triton
    body = {"text_input": "The list object", "max_tokens": 8, "stream": False,
            "sampling_parameters": json.dumps({"ignore_eos": True})}
    whole = httpx.post(f"{url}/v2/models/tiny-q4/generate", json=body, timeout=60).json()
    assert whole["finish_reason"] == "length" and whole["text_output"] == _alone(path, "The list object", 8, "q4_0")


def test_a_client_that_leaves_is_cancelled(triton):
    url, _, log = triton
    body = {"text_input": "Once", "max_tokens": 80, "stream": True,
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
