"""verify --url: a correct server passes; servers broken the ways deployments break (a rope base off by
one part in a thousand, a chat template that drops the system message, one layer's weights
perturbed, a tokenizer missing one merge) fail with the diagnosis pointing at the right place, on
`linnet serve` everywhere and on llama-server where it is built; a server without logprobs, one that
times out or answers malformed JSON; the baseline gates of verify and bench."""

from __future__ import annotations

import json
import os
import signal
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from family_fixtures import CASES, TOKENIZED_VOCAB, make_checkpoint
import broken_servers
from broken_servers import EXPECTED
from server_fixtures import app_in_thread, built_llama_server, served_checkpoint
from test_cli import assert_one_line_error, invoke
from tokenizer_fixtures import write_tokenizer

from linnet_core.bench import llama_server
from linnet_core.check.baseline import bench_gate
from linnet_core.check.served import DEFAULT_PROMPTS, verify_server
from linnet_core.tokenizer import Tokenizer

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

CHATML = (Path(__file__).parents[1] / "linnet_core" / "default_model" / "chat_template.jinja").read_text()


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    """A tiny Qwen3 with a byte-level BPE tokenizer, ChatML and room for the default prompts."""
    case = next(c for c in CASES if c.id == "qwen3-legacy-untied")
    folder = make_checkpoint(case, tmp_path_factory.mktemp("verify-url") / "qwen3", vocab_size=TOKENIZED_VOCAB,
                             max_position_embeddings=1024)
    write_tokenizer(folder, case.tokenizer, TOKENIZED_VOCAB)
    (folder / "chat_template.jinja").write_text(CHATML)
    for name in ("<|im_start|>", "<|im_end|>"):
        assert Tokenizer(folder).token_id(name) is not None, "the fixture's tokenizer lacks ChatML's markers"
    return folder


@pytest.fixture(scope="module")
def variants(model, tmp_path_factory) -> dict[str, Path]:
    """The model's GGUF (float32) and four broken copies of it."""
    out = tmp_path_factory.mktemp("variants")
    good = out / "correct.gguf"
    r = invoke("export", "gguf", str(model), str(good), "--dtype", "f32", "--no-check", "--quiet")
    assert r.exit_code == 0, r.stderr
    return {"correct": good, **broken_servers.make(model, good, out, list(DEFAULT_PROMPTS))}


def test_a_correct_linnet_server_passes(model, variants):
    with served_checkpoint(variants["correct"], cache_len=1024, rows=2) as (url, *_):
        r = verify_server(model, url + "/v1", dtype="float32")
    assert r.passed, [c.finding for c in r.comparisons] + r.diagnosis
    assert r.tokenizer["checked"] == "/tokenize" and r.template["checked"] == "/tokenize with messages"
    assert r.capabilities["prompt_logprobs"] == "echo" and r.capabilities["token_ids"] == "token_id:N"
    assert all(c.top_overlap == 1.0 and c.agreement == len(c.tokens) for c in r.comparisons)
    assert max(c.max_dlogprob for c in r.comparisons) < r.tolerance / 10


@pytest.mark.parametrize("broken", list(EXPECTED))
def test_each_broken_linnet_server_fails_where_it_is_broken(model, variants, broken):
    with served_checkpoint(variants[broken], cache_len=1024, rows=2) as (url, *_):
        r = verify_server(model, url + "/v1", dtype="float32")
    assert not r.passed
    assert r.diagnosis == [EXPECTED[broken]], (r.diagnosis, r.tokenizer, r.template,
                                               [c.finding for c in r.comparisons])


@pytest.mark.slow
@pytest.mark.skipif(built_llama_server() is None,
                    reason="no llama-server here (linnet bench --serving --target llama-server --build-llama-server)")
@pytest.mark.parametrize("variant", ["correct", *EXPECTED])
def test_llama_server_passes_correct_and_fails_each_broken_variant(model, variants, variant, tmp_path):
    # float32 attention: llama-server's defaults would be a float16 claim
    proc, url, _ = llama_server.start(Path(built_llama_server()), variants[variant], 1, 1024, 2, tmp_path / "log",
                                      timeout=120, flags=llama_server.FLOAT32_ATTENTION)
    try:
        r = verify_server(model, url + "/v1", dtype="float32")
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
    if variant == "correct":
        assert r.passed, [c.finding for c in r.comparisons] + r.diagnosis
        assert r.template["checked"] == "/apply-template" and "return_tokens" in r.capabilities["token_ids"]
    else:
        assert r.diagnosis == [EXPECTED[variant]], (r.diagnosis, r.tokenizer, r.template)


class _Fake(BaseHTTPRequestHandler):
    """A server that answers /v1/models, then `reply` for everything else."""
    reply: bytes = b"{}"
    delay: float = 0.0

    def _send(self, body: bytes):
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        try:
            self.wfile.write(body)
        except BrokenPipeError:  # the client gave up waiting: that is the case under test
            pass

    def do_GET(self):  # noqa: N802 - http.server's name
        self._send(json.dumps({"data": [{"id": "fake", "owned_by": "fake"}]}).encode())

    def do_POST(self):  # noqa: N802
        import time

        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        time.sleep(self.delay)
        self._send(self.reply)

    def log_message(self, *args):
        pass


def _fake(reply: bytes, delay: float = 0.0):
    handler = type("Handler", (_Fake,), {"reply": reply, "delay": delay})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/v1"


@pytest.mark.parametrize("reply,delay,says", [
    (b"<html>not json</html>", 0.0, "answered, but not with JSON"),
    (b'{"choices": []}', 0.0, "answered without choices"),
    (b"{}", 3.0, "did not answer within 1 s"),
])
def test_a_broken_api_is_one_line_and_exit_1(model, reply, delay, says):
    server, url = _fake(reply, delay)
    try:
        r = invoke("verify", str(model), "--url", url, "--timeout", "1")
    finally:
        server.shutdown()
    assert r.exit_code == 1
    assert_one_line_error(r, contains=says)


def test_an_unreachable_server_is_one_line(model):
    from linnet_core.serve import free_port

    r = invoke("verify", str(model), "--url", f"http://127.0.0.1:{free_port()}/v1")
    assert r.exit_code == 1
    assert_one_line_error(r, contains="cannot reach")


def test_a_server_without_logprobs_says_what_was_still_checked(model):
    """A correct server behind a proxy that strips logprobs (and /tokenize, and echo) from its answers.
    The checkpoint itself is served: its GGUF names the vocabulary's padding ids "[PAD381]" in text, which
    a random model writes and a text-only comparison cannot tell from a wrong token."""
    import httpx
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse

    with served_checkpoint(model, cache_len=1024, rows=2) as (inner, *_):
        async def forward(request: Request):
            body = await request.json() if request.method == "POST" else None
            if request.url.path in ("/tokenize", "/apply-template"):
                return JSONResponse({"error": {"message": "not found"}}, status_code=404)
            if body and body.pop("echo", None):
                return JSONResponse({"error": {"message": "echo is not supported"}}, status_code=400)
            async with httpx.AsyncClient(base_url=inner) as c:
                r = await (c.post(request.url.path, json=body) if body is not None else c.get(request.url.path))
            out = r.json()
            for ch in out.get("choices", []):
                ch["logprobs"] = None
            return JSONResponse(out, status_code=r.status_code)

        app = Starlette()
        app.add_route("/{path:path}", forward, methods=["GET", "POST"])
        with app_in_thread(app) as url:
            r = invoke("verify", str(model), "--url", url + "/v1", "--dtype", "float32")
    assert r.exit_code == 0, r.stdout + r.stderr
    assert "returns no logprobs: only the tokenizer, the chat template and the greedy tokens" in r.stdout
    assert "tokenizer (prompt counts in usage)" in r.stdout and "chat template (prompt counts in usage)" in r.stdout


def test_verify_baseline_passes_the_same_server_and_fails_a_moved_one(model, variants, tmp_path):
    saved = tmp_path / "base.json"
    with served_checkpoint(variants["correct"], cache_len=1024, rows=2) as (url, *_):
        r = invoke("verify", str(model), "--url", url + "/v1", "--save", str(saved), "--quiet")
        assert r.exit_code == 0, r.stderr
        same = invoke("verify", str(model), "--url", url + "/v1", "--baseline", str(saved))
        assert same.exit_code == 0, same.stdout + same.stderr
        assert "against the baseline" in same.stdout and "the same greedy tokens" in same.stdout
        doc = json.loads(saved.read_text())
        doc["comparisons"][0]["logprobs"] = [v - 0.05 for v in doc["comparisons"][0]["logprobs"]]  # a kernel changed
        moved = tmp_path / "moved.json"
        moved.write_text(json.dumps(doc))
        r = invoke("verify", str(model), "--url", url + "/v1", "--baseline", str(moved))
        assert r.exit_code == 3 and "drift from the baseline" in r.stdout
        doc["environment"]["cpu"] = "Some Other CPU"
        other = tmp_path / "other.json"
        other.write_text(json.dumps(doc))
        r = invoke("verify", str(model), "--url", url + "/v1", "--baseline", str(other))
        assert_one_line_error(r, contains="was measured on another machine")
        r = invoke("verify", str(model), "--url", url + "/v1", "--baseline", str(other), "--other-machine")
        assert r.exit_code == 3 and "warning:" in r.stderr


def _bench_doc(tok_s: list[float], ttft_s: list[float], cpu: str = "CPU X") -> dict:
    return {"model": "m", "dtype": "float32", "method": {"prompt_tokens": 8, "new_tokens": 4, "batch": 1},
            "environment": {"cpu": cpu, "threads": 2, "device": "cpu", "versions": {"torch": "2.13.0"}},
            "sides": [{"key": "linnet-torch", "status": "ok",
                       "samples": [{"decode_tok_s": a, "ttft_s": b} for a, b in zip(tok_s, ttft_s)]}]}


def test_bench_baseline_fails_a_slow_run_and_passes_an_accurate_one(tmp_path):
    old = _bench_doc([100, 102, 98, 101, 99], [0.10, 0.11, 0.10, 0.10, 0.11])
    slow = _bench_doc([88, 90, 89, 87, 91], [0.10, 0.11, 0.10, 0.10, 0.11])  # 11% slower decode, every run
    noisy = _bench_doc([97, 103, 99, 100, 98], [0.11, 0.10, 0.10, 0.11, 0.10])  # the same speed, other samples
    one_outlier = _bench_doc([100, 101, 70, 99, 102], [0.10, 0.11, 0.10, 0.10, 0.11])  # one bad run: median holds
    warn = []
    verdict = bench_gate(slow, old, tmp_path / "old.json", 0.05, False, warn.append)
    assert not verdict["passed"] and "linnet-torch decode_tok_s 11.0% slower" in verdict["summary"]
    assert bench_gate(noisy, old, tmp_path / "old.json", 0.05, False, warn.append)["passed"]
    assert bench_gate(one_outlier, old, tmp_path / "old.json", 0.05, False, warn.append)["passed"]
    assert bench_gate(slow, old, tmp_path / "old.json", 0.15, False, warn.append)["passed"]  # within the bound
    from linnet_core.errors import InputError

    with pytest.raises(InputError, match="another machine"):
        bench_gate(slow, _bench_doc([100] * 5, [0.1] * 5, cpu="CPU Y"), tmp_path / "old.json", 0.05, False, warn.append)
    assert not warn
    bench_gate(slow, _bench_doc([100] * 5, [0.1] * 5, cpu="CPU Y"), tmp_path / "old.json", 0.05, True, warn.append)
    assert warn and "another machine" in warn[0]
    with pytest.raises(InputError, match="timed runs"):
        bench_gate(_bench_doc([90, 91], [0.1, 0.1]), _bench_doc([100, 101], [0.1, 0.1]), tmp_path / "o", 0.05,
                   False, warn.append)


def test_bench_baseline_on_the_command_line(checkpoints, tmp_path):
    """A real bench saved, then gated against itself (passes) and against a fabricated faster past (exit 3)."""
    path = checkpoints["qwen3-legacy-untied"]
    saved = tmp_path / "run.json"
    common = ["bench", str(path), "--backend", "torch", "--compare", "none", "--runs", "3", "--warmups", "1",
              "--prompt-tokens", "8", "--new-tokens", "4", "--dtype", "float32"]
    r = invoke(*common, "--save", str(saved), "--quiet")
    assert r.exit_code == 0, r.stderr
    doc = json.loads(saved.read_text())
    for side in doc["sides"]:
        for s in side["samples"]:
            if s.get("decode_tok_s"):
                s["decode_tok_s"] *= 10  # the past ran ten times faster
    fast = tmp_path / "fast.json"
    fast.write_text(json.dumps(doc))
    r = invoke(*common, "--baseline", str(fast), "--max-slowdown", "5%", "--quiet")
    assert r.exit_code == 3 and "slower" in r.stderr, r.stderr
    r = invoke(*common, "--baseline", str(saved), "--max-slowdown", "bad")
    assert_one_line_error(r, contains="--max-slowdown must be")
    (tmp_path / "junk.json").write_text("[1, 2]")
    r = invoke(*common, "--baseline", str(tmp_path / "junk.json"))
    assert_one_line_error(r, contains="not a saved run of `linnet bench --json`")


def test_prompts_files_and_a_prompt_past_the_servers_context(model, tmp_path):
    text = tmp_path / "prompts.txt"
    text.write_text("First extra prompt\\nwith a newline\n\nSecond extra prompt\n")
    chats = tmp_path / "chats.jsonl"
    chats.write_text(json.dumps({"messages": [{"role": "user", "content": "Hello there"}]}) + "\n"
                     + json.dumps({"prompt": "A third"}) + "\n")
    with served_checkpoint(model, cache_len=200, rows=2) as (url, *_):  # the long default prompt does not fit
        r = invoke("verify", str(model), "--url", url + "/v1", "--prompts", str(text), "--json")
        assert r.exit_code == 0, r.stdout + r.stderr
        doc = json.loads(r.stdout)
        names = [c["name"] for c in doc["comparisons"]]
        assert names == ["prompt 1", "prompt 2", "prompt 3", "chat 1", "prompt 5", "prompt 6"]
        assert any("prompt 4 not checked" in m and "HTTP 400" in m for m in doc["missing"])
        r = invoke("verify", str(model), "--url", url + "/v1", "--prompts", str(chats), "--json")
        assert r.exit_code == 0, r.stdout + r.stderr
        assert [c["kind"] for c in json.loads(r.stdout)["comparisons"]][-2:] == ["chat", "completion"]
        bad = tmp_path / "bad.jsonl"
        bad.write_text('{"prompt": 3}\n')
        r = invoke("verify", str(model), "--url", url + "/v1", "--prompts", str(bad))
        assert_one_line_error(r, contains="line 1: give")


def test_server_options_without_url_are_refused(model):
    r = invoke("verify", str(model), "--prompts", "p.txt")
    assert_one_line_error(r, contains="--prompts is for checking a server: give --url too")


@pytest.mark.parametrize("entry,says", [
    ('{"id": 99999, "token": "x", "logprob": -1.0, "top_logprobs": []}', "outside the model's vocabulary"),
    ('{"id": 5, "token": "x", "logprob": NaN, "top_logprobs": [{"id": 5, "logprob": NaN}]}', "not finite"),
])
def test_answers_no_model_could_give_fail_without_a_traceback(model, entry, says):
    reply = ('{"choices": [{"index": 0, "text": "x", "finish_reason": "length", "logprobs": {"content": [%s]}}], '
             '"usage": {"prompt_tokens": 3, "completion_tokens": 1}}' % entry).encode()
    server, url = _fake(reply)
    try:
        r = invoke("verify", str(model), "--url", url)
    finally:
        server.shutdown()
    assert r.exit_code == 3 and "Traceback" not in r.stdout + r.stderr, r.stdout + r.stderr
    assert says in r.stdout
