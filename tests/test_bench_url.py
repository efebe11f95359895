"""`linnet bench --serving --url`: the address as OpenAI clients write it, a server that answers
something else, a request that fails and why; llama-server as a target when its binary is missing."""

from __future__ import annotations

import json

import pytest
from test_cli import assert_one_line_error, invoke

from linnet_core.bench import llama_server
from linnet_core.bench.serving.clients import run_http, server_root
from linnet_core.bench.serving.report import notes
from linnet_core.bench.serving.result import summarize
from linnet_core.bench.serving.workload import Workload
from linnet_core.errors import InputError

from server_fixtures import app_in_thread, built_llama_server

BROKEN = 13  # a prompt starting with this token gets an error event after two tokens


def fake_openai(models_body=None):
    """A small OpenAI-compatible server: /v1/models and streamed /v1/completions, a token per event."""
    from fastapi import FastAPI
    from fastapi.responses import HTMLResponse, StreamingResponse

    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        if models_body is not None:
            return HTMLResponse(models_body)
        return {"object": "list", "data": [{"id": "fake", "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(body: dict):
        app.state.bodies = getattr(app.state, "bodies", []) + [body]
        n, broken = body["max_tokens"], body["prompt"][0] == BROKEN

        async def events():
            for i in range(n):
                if broken and i == 2:
                    yield 'data: {"error": {"message": "slot unavailable", "code": 500}}\n\n'
                    return
                last = i == n - 1
                chunk = {"choices": [{"text": "x", "index": 0, "finish_reason": "length" if last else None}]}
                if last:
                    chunk["usage"] = {"prompt_tokens": len(body["prompt"]), "completion_tokens": n}
                yield f"data: {json.dumps(chunk)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def fake_url():
    with app_in_thread(fake_openai()) as url:
        yield url


@pytest.mark.parametrize("suffix", ["", "/", "/v1", "/v1/"])
def test_the_bare_address_and_the_v1_base_both_work(fake_url, suffix):
    w = Workload(requests=4, prompt_min=3, prompt_max=5, new_tokens=5, concurrency=2)
    results, wall = run_http(fake_url + suffix, w, w.prompts(100))
    row = summarize("url", results, wall, w)
    assert row.failed == 0 and row.output_tokens == 20


def test_request_fields_ride_on_every_request():
    app = fake_openai()
    fields = {"response_format": {"type": "json_object"}, "presence_penalty": 0.5}
    with app_in_thread(app) as url:
        w = Workload(requests=3, prompt_min=3, prompt_max=3, new_tokens=2, concurrency=3, request_fields=json.dumps(fields))
        results, _ = run_http(url, w, w.prompts(100))
    assert all(r.ok for r in results) and len(app.state.bodies) == 3
    assert all(b["response_format"] == fields["response_format"] and b["presence_penalty"] == 0.5 for b in app.state.bodies)
    with pytest.raises(InputError, match="may not set max_tokens"):
        Workload(request_fields='{"max_tokens": 3}')
    r = invoke("bench-serving", "--target", "engine", "--request-fields", '{"n": 2}')
    assert_one_line_error(r, contains="OpenAI-compatible targets only")


def test_a_failed_request_says_why_in_the_json_and_the_notes(fake_url):
    w = Workload(requests=3, prompt_min=3, prompt_max=3, new_tokens=5, concurrency=3)
    prompts = [[1, 2, 3], [BROKEN, 2, 3], [4, 5, 6]]
    results, wall = run_http(fake_url + "/v1", w, prompts)
    row = summarize("url", results, wall, w)
    row.label = "fake"
    assert row.failed == 1 and row.output_tokens == 10
    assert row.errors == ['the server\'s error event: {"message": "slot unavailable", "code": 500}']
    assert row.to_json()["errors"] == row.errors
    assert any("1 of 3 requests failed" in n and "slot unavailable" in n for n in notes([row]))


def test_a_server_that_is_not_openai_compatible_is_one_line(tokenized_checkpoints):
    with app_in_thread(fake_openai(models_body="<html>hello</html>")) as url:
        r = invoke("bench", tokenized_checkpoints["qwen2-bias-tied"], "--serving", "--target", "sequential",
                   "--requests", "2", "--prompt-range", "3-4", "--new-tokens", "2", "--url", url + "/v1")
    assert_one_line_error(r, contains="not with an OpenAI model list")
    assert "KeyError" not in r.stderr


def test_unreachable_and_malformed_addresses_are_one_line():
    with pytest.raises(InputError, match="must start with http"):
        server_root("localhost:8000/v1")
    w = Workload(requests=1, prompt_min=3, prompt_max=3, new_tokens=2, concurrency=1)
    with pytest.raises(InputError, match="cannot reach"):
        run_http("http://127.0.0.1:9/v1", w, [[1, 2, 3]])


def test_llama_server_missing_is_the_reason_and_the_command(tokenized_checkpoints, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no llama-server on PATH
    monkeypatch.setenv("LINNET_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("LINNET_LLAMA_SERVER", raising=False)
    assert llama_server.find() is None
    r = invoke("bench", tokenized_checkpoints["qwen2-bias-tied"], "--serving", "--target", "llama-server",
               "--requests", "2", "--prompt-range", "3-4", "--new-tokens", "2")
    assert_one_line_error(r, contains="llama-server is not on PATH")
    assert "--build-llama-server" in r.stderr
    monkeypatch.setenv("LINNET_LLAMA_SERVER", str(tmp_path / "nothing"))
    with pytest.raises(InputError, match="not an executable"):
        llama_server.find()


@pytest.mark.skipif(built_llama_server() is None,
                    reason="no llama-server here (linnet bench --serving --target llama-server --build-llama-server)")
def test_llama_server_serves_the_same_requests_beside_linnet(tokenized_checkpoints, monkeypatch, tmp_path):
    monkeypatch.setenv("LINNET_LLAMA_SERVER", built_llama_server())
    out = tmp_path / "serving.json"
    r = invoke("bench", tokenized_checkpoints["qwen2-bias-tied"], "--serving", "--target", "http,llama-server",
               "--requests", "6", "--prompt-range", "4-12", "--new-tokens", "5", "--concurrency", "3", "--rows", "3",
               "--shared-prefix", "20", "--save", out, "--markdown")
    assert r.exit_code == 0, r.stderr
    data = json.loads(out.read_text())
    rows = {t["target"]: t for t in data["targets"]}
    assert rows["llama-server"]["failed"] == 0 and rows["llama-server"]["output_tokens"] == 6 * 5
    assert rows["http"]["failed"] == 0 and rows["http"]["output_tokens"] == 6 * 5
    assert "-np 3" in rows["llama-server"]["note"] and "llama-server (llama.cpp)" in r.stdout


FAKE_LLAMA_SERVER = """#!{python}
# Crashes as llama.cpp's AMX matmul does at start-up unless told --no-repack (or always, if {always});
# else answers /health.
import http.server, os, signal, sys
args = sys.argv[1:]
if {always} or "--no-repack" not in args:
    os.kill(os.getpid(), signal.SIGSEGV)
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"{{}}")
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", int(args[args.index("--port") + 1])), Health).serve_forever()
"""


@pytest.mark.parametrize("always", [False, True])
def test_a_llama_server_that_crashes_at_start_up_runs_again_without_repacking(tmp_path, always):
    import os
    import signal
    import sys

    binary = tmp_path / "llama-server"
    binary.write_text(FAKE_LLAMA_SERVER.format(python=sys.executable, always=always))
    binary.chmod(0o700)
    if always:  # a crash the workaround does not mend is the reason, once
        with pytest.raises(InputError, match="llama-server exited with -11"):
            llama_server.start(binary, tmp_path / "m.gguf", 2, 16, 1, tmp_path / "log", timeout=30)
        return
    proc, url, workaround = llama_server.start(binary, tmp_path / "m.gguf", 2, 16, 1, tmp_path / "log", timeout=30)
    try:
        assert workaround == ("--no-repack",) and url.startswith("http://127.0.0.1:")
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)
