"""`linnet bench` on a tiny fixture: a complete JSON, a page that parses, Markdown, Ctrl-C."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest
from test_cli import assert_one_line_error, invoke

from linnet_core.bench.machine import decode_bytes_per_step
from linnet_core.bench.report import METRICS, number
from linnet_core.bench.run import bench
from linnet_core.bench.subjects import Method, pick
from linnet_core.models import load_spec
from linnet_core.speculation import SpeculationOptions
from server_fixtures import built_llama_server

CASE = "qwen3-headdim128"
FAST = ["--prompt-tokens", "16", "--new-tokens", "4", "--runs", "2", "--warmups", "1"]
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def full_run(checkpoints, tmp_path_factory):
    """One `linnet bench --backend all --compare all` run, its JSON and its page, shared below."""
    out = tmp_path_factory.mktemp("bench")
    r = invoke("bench", checkpoints[CASE], "--backend", "all", "--compare", "all", *FAST, "--json",
               "--html", out / "page.html")
    assert r.exit_code == 0, r.stderr
    return json.loads(r.stdout), (out / "page.html").read_text()


@pytest.mark.slow
def test_json_is_complete(full_run):
    data, _ = full_run
    assert data["method"]["runs"] == 2 and data["method"]["warmups"] == 1 and not data["interrupted"]
    env = data["environment"]
    assert env["versions"]["linnet"] and env["versions"]["torch"] and env["threads"] > 0 and env["date"]
    assert data["bandwidth_bytes_s"] > 0 and data["decode_bytes_per_step"] > 0
    sides = {s["key"]: s for s in data["sides"]}
    assert sides["transformers"]["status"] == "ok" and sides["transformers"]["decode_speedup"] == 1.0
    ran = [s for s in data["sides"] if s["status"] == "ok"]
    assert {"transformers", "linnet:torch", "linnet:inductor"} <= {s["key"] for s in ran}
    for s in ran:
        assert len(s["samples"]) == 2, s["key"]
        for key in ("ttft_ms", "decode_tok_s", "load_s", "peak_memory_bytes", "decode_speedup", "roofline"):
            assert s[key] is not None and s[key] > 0, (s["key"], key)
        if s["key"] != "llama-server":  # its /completion gives no logits
            assert s["distance"] is not None and s["distance"] >= 0
        if s["linnet"]:
            assert s["distance"] <= 1e-3 and s["artifact_cached"] is not None
    # What cannot run here is listed with the reason, never dropped.
    for key in ("vllm", "sglang", "linnet:cudagraphs", "linnet:tensorrt"):
        assert sides[key]["status"] == "missing" and sides[key]["reason"], key
    if shutil.which("nvidia-smi") is None:
        assert "GPU" in sides["linnet:cudagraphs"]["reason"]


class _Page(HTMLParser):
    def __init__(self):
        super().__init__()
        self.svgs, self.rows, self.links, self.tags = 0, 0, [], []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        self.svgs += tag == "svg"
        self.rows += tag == "tr"
        self.links += [v for k, v in attrs if k in ("src", "href") and v]


@pytest.mark.slow
def test_page_is_self_contained_with_a_chart_per_metric(full_run):
    data, html = full_run
    page = _Page()
    page.feed(html)
    assert page.svgs == len(METRICS)
    assert page.rows == len(data["sides"]) + 1  # the every-number table, with its header
    assert page.links == [] and "<script" not in html  # nothing fetched, nothing run
    assert html.count('fill="#c0262d"') == len(METRICS)  # one best bar per chart
    for side in data["sides"]:
        assert side["label"].replace("'", "&#x27;") in html
    assert "Reproduce: <code>linnet" in html


def test_markdown_and_ctrl_c(checkpoints, tmp_path):
    r = invoke("bench", checkpoints[CASE], "--backend", "torch", "--compare", "none", *FAST, "--markdown",
               "--sequential")
    assert r.exit_code == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[2].startswith("| side | TTFT | decode |")
    assert any(line.startswith("| Linnet, generated PyTorch |") for line in lines)
    assert any(line.startswith("| transformers |") for line in lines)
    assert "| 1.00× |" in r.stdout and "e-0" in r.stdout  # the ratio column, and a distance

    def interrupt(side):  # Ctrl-C after the first timed sample
        raise KeyboardInterrupt

    result = bench(checkpoints[CASE], Method(16, 4, 1, 3, 0), pick(["torch"], []), workdir=tmp_path,
                   on_sample=interrupt)
    assert result.interrupted and result.completed_runs == 0
    measured = [s for s in result.sides if s.samples]
    assert len(measured) == 1 and measured[0].samples[0]["decode_tok_s"] > 0
    assert all(s.worker is None for s in result.sides)  # every worker process stopped
    left = subprocess.run(["pgrep", "-P", str(os.getpid()), "-f", "linnet_core.bench.worker"],  # our own only
                          capture_output=True, text=True).stdout
    assert left.strip() == ""


@pytest.mark.parametrize("args,text", [
    (["--runs", "0"], "--runs must be at least 1"),
    (["--new-tokens", "1"], "--new-tokens must be at least 2"),
    (["--backend", "tpu"], "unknown backend 'tpu'"),
    (["--compare", "tgi"], "unknown comparator 'tgi'"),
    (["--device", "npu"], "unknown device 'npu'"),
    (["--speculate", "ngram", "--batch", "2"], "--speculate and --draft measure one sequence"),
    (["--speculate", "beam"], "--speculate takes ngram or draft"),
    (["--speculate", "ngram", "--serving"], "--speculate and --draft time one sequence's decode"),
])
def test_bad_input_is_one_line(args, text, checkpoints):
    assert_one_line_error(invoke("bench", checkpoints[CASE], *args), 1, text)


def test_decode_bytes_count_weights_once_and_the_kv_cache(checkpoints):
    spec = load_spec(checkpoints["llama-gqa-untied"])  # untied: the head is read, the embedding gathered
    H, F, V, L = spec.hidden_size, spec.intermediate_size, spec.vocab_size, spec.num_layers
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    per_layer = H * q + 2 * H * kv + q * H + 3 * H * F + 2 * H
    weights = (L * per_layer + H + V * H) * 4
    kv_bytes = L * 2 * kv * 4 * 10.0 * 2
    assert decode_bytes_per_step(spec, "float32", 10.0, 2) == weights + kv_bytes
    # q8_0: every matrix but the gathered table in 34-byte blocks of 32, the norms and the cache float32
    blocks = (L * (per_layer - 2 * H) + V * H) // 32 * 34 + (L * 2 * H + H) * 4
    assert decode_bytes_per_step(spec, "q8_0", 10.0, 2) == blocks + kv_bytes


def test_numbers_read_like_the_pages():
    assert [number(v) for v in (0, 0.000123, 0.718, 2.1, 17.42, 246.3, 14835.2)] == \
        ["0", "1.23e-04", "0.718", "2.10", "17.4", "246", "14,835"]


def test_screenshot_in_headless_chromium(full_run, tmp_path):
    """The page as a browser draws it (the script that keeps docs/bench-page.png current)."""
    if not (shutil.which("chromium") or shutil.which("chromium-browser")):
        pytest.skip("chromium is not installed (apt-get install chromium)")
    _, html = full_run
    page = tmp_path / "page.html"
    page.write_text(html)
    png = tmp_path / "page.png"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "screenshot_page.py"), str(page), str(png)], check=True,
                   timeout=180)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000


def test_serving_bench_json_and_page(tokenized_checkpoints, tmp_path):
    """`--serving` on a tiny model: every target completes every request, with latencies and a page."""
    out = tmp_path / "serving.json"
    r = invoke("bench", tokenized_checkpoints["qwen2-bias-tied"], "--serving", "--requests", "12", "--prompt-range",
               "4-20", "--new-tokens", "6", "--concurrency", "4", "--rows", "4", "--save", out,
               "--html", tmp_path / "serving.html", "--markdown")
    assert r.exit_code == 0, r.stderr
    assert "not a steady state" in r.stderr  # 12 requests at 4 in flight
    data = json.loads(out.read_text())
    assert [t["target"] for t in data["targets"]] == ["sequential", "engine", "http"]
    for t in data["targets"]:
        assert t["failed"] == 0 and t["output_tokens"] == 12 * 6, t
        for key in ("output_tok_s", "request_s", "ttft_ms_median", "ttft_ms_p99", "tpot_ms_median", "itl_ms_p99",
                    "e2e_ms_median", "e2e_ms_p99", "peak_memory_bytes"):
            assert t[key] is not None and t[key] > 0, (t["target"], key)
    assert data["targets"][0]["speedup"] == 1.0
    page = _Page()
    page.feed((tmp_path / "serving.html").read_text())
    assert page.svgs == 4 and page.rows == 4 and page.links == []
    assert "| linnet serve, over HTTP |" in r.stdout


def test_serving_rounds_interleave_and_report_the_median(tokenized_checkpoints, tmp_path):
    out = tmp_path / "serving.json"
    r = invoke("bench-serving", tokenized_checkpoints["qwen2-bias-tied"], "--requests", "6", "--prompt-range",
               "4-12", "--new-tokens", "4", "--concurrency", "2", "--rows", "2", "--target", "sequential,engine",
               "--rounds", "3", "--decode-stall", "0", "--no-prefix-caching", "--save", out, "--markdown")
    assert r.exit_code == 0, r.stderr
    assert "(round 2 of 3)" in r.stderr and "median of 3 interleaved rounds" in r.stdout
    assert "prompt chunks unbounded by decode" in r.stdout  # --decode-stall 0 reached the engine's header
    data = json.loads(out.read_text())
    assert data["rounds"] == 3 and data["decode_stall"] is None
    assert data["engine"]["prefix_caching"] is False and data["engine"]["rows"] == 2
    for t in data["targets"]:
        rounds = t["rounds_output_tok_s"]
        assert len(rounds) == 3 and t["output_tok_s"] == sorted(rounds)[1] and t["failed"] == 0
    assert "Output tok/s in each round" in r.stdout
    bad = invoke("bench", tokenized_checkpoints["qwen2-bias-tied"], "--serving", "--rounds", "0")
    assert bad.exit_code == 2 and "--rounds" in bad.stderr
    bad = invoke("bench-serving", tokenized_checkpoints["qwen2-bias-tied"], "--decode-stall", "0.5")
    assert bad.exit_code == 1 and "--decode-stall is 0 (off) or at least 1" in bad.stderr


def test_sequential_probes_beside_each_side_and_flags_an_under_read(checkpoints, monkeypatch, tmp_path):
    """A probe that reads less than a side moves is said to have under-read, never shown as a bare >100%."""
    import linnet_core.bench.run as run
    from linnet_core.bench.report import markdown, roofline

    probes = []

    def probe(device, *a, **k):
        probes.append(device)
        return 1e3  # bytes/s: far below what any side moves

    monkeypatch.setattr(run, "stream_bandwidth", probe)
    method = Method(prompt_tokens=8, new_tokens=4, runs=1, warmups=0)
    result = bench(checkpoints["llama-gqa-untied"], method, pick(["torch"], []), "cpu", tmp_path, sequential=True)
    rows = {r["key"]: r for r in result.rows()}
    assert len(probes) == 2 + 2  # start, one beside each of the two sides, end
    assert all(r["bandwidth_probe_bytes_s"] == 1e3 for r in rows.values())
    assert rows["linnet:torch"]["roofline_under_read"] and roofline(rows["linnet:torch"]).endswith("%*")
    assert "probe read less than that side moved" in markdown(result)


def test_a_failed_side_is_reported_by_its_exception_not_a_later_warning(tmp_path):
    """The first GPU pass reported transformers-compiled as '... [__cudagraphs] )', a warning printed
    after the traceback that said why."""
    from linnet_core.bench.run import Worker

    log = tmp_path / "side.log"
    log.write_text("Traceback (most recent call last):\n  File \"x.py\", line 1, in <module>\n"
                   "torch._dynamo.exc.BackendCompilerFailed: backend='inductor' raised: out of memory\n\n"
                   "W1130 21:40:56.999000 16069 torch/_inductor/cudagraph_utils.py:207] [__cudagraphs] \n")
    worker = object.__new__(Worker)  # tail() reads the log alone
    worker.log = log
    assert worker.tail().startswith("torch._dynamo.exc.BackendCompilerFailed: backend='inductor'")
    log.write_text("a plain last line\n")
    assert worker.tail() == "a plain last line"


def test_speculative_bench_times_plain_and_speculative_decode_in_each_run(checkpoints, tmp_path):
    r = invoke("bench", checkpoints[CASE], "--backend", "torch", "--compare", "none", "--speculate", "ngram",
               "--draft-tokens", "3", "--prompt-tokens", "16", "--new-tokens", "24", "--runs", "2", "--warmups", "0",
               "--json", "--html", tmp_path / "page.html")
    assert r.exit_code == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["method"]["speculation"]["method"] == "ngram" and data["method"]["speculation"]["draft_tokens"] == 3
    side = next(s for s in data["sides"] if s["key"] == "linnet:torch")
    sp = side["speculative"]
    assert sp["same_output"] is True and sp["decode_tok_s"] > 0 and sp["plain_decode_tok_s"] > 0
    assert 0.0 <= sp["acceptance"] <= 1.0 and sp["tokens_per_step"] >= 1.0
    assert sp["speedup"] == pytest.approx(sp["decode_tok_s"] / sp["plain_decode_tok_s"])
    assert all({"plain_decode_tok_s", "acceptance", "same_output"} <= set(x) for x in side["samples"])
    ref = next(s for s in data["sides"] if s["key"] == "transformers")
    assert ref["speculative"] is None  # the reference decodes plainly
    assert "Linnet, generated PyTorch: speculative" in (tmp_path / "page.html").read_text()


@pytest.mark.slow
@pytest.mark.skipif(built_llama_server() is None,
                    reason="no llama-server here (linnet bench --compare llama-server --build-llama-server)")
def test_llama_server_speculates_with_the_same_draft_gguf(tokenized_checkpoints, monkeypatch, tmp_path):
    monkeypatch.setenv("LINNET_LLAMA_SERVER", built_llama_server())
    model = tokenized_checkpoints["qwen2-bias-tied"]
    result = bench(model, Method(16, 12, 1, 2, 0, "float32", speculation=SpeculationOptions(draft=str(model))),
                   pick(["torch"], ["llama-server"]), workdir=tmp_path)
    server = result.side("llama-server")
    assert server.status == "ok", server.reason
    assert (tmp_path / "draft.gguf").exists() and (tmp_path / "model.gguf").exists()
    sp = result.rows()[[s.subject.key for s in result.sides].index("llama-server")]["speculative"]
    assert sp["decode_tok_s"] > 0 and sp["plain_decode_tok_s"] > 0
    assert sp["acceptance"] > 0.9  # the draft is the target itself: llama.cpp keeps its proposals
    linnet = result.side("linnet:torch").speculative()
    assert linnet["same_output"] and linnet["acceptance"] > 0.9
    assert server.memory["peak_bytes"] > 0 and "llama-server" in server.memory["source"]
    left = subprocess.run(["pgrep", "-f", f"llama-server.*{tmp_path}"], capture_output=True, text=True).stdout
    assert left.strip() == ""  # its servers stopped with the worker


def test_a_prompt_file_is_the_prompt_and_a_bad_one_is_one_line(tokenized_checkpoints, tmp_path):
    from linnet_core.tokenizer import Tokenizer

    model = tokenized_checkpoints["qwen2-bias-tied"]
    text = tmp_path / "prompt.txt"
    text.write_text("one two three, one two three, one two three")
    r = invoke("bench", model, "--backend", "torch", "--compare", "none", "--prompt-file", text, "--new-tokens", "4",
               "--runs", "1", "--warmups", "0", "--json")
    assert r.exit_code == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["method"]["prompt_tokens"] == len(Tokenizer(model).encode(text.read_text()))
    assert data["method"]["prompt_file"] == str(text)
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert_one_line_error(invoke("bench", model, "--prompt-file", empty, "--compare", "none", "--backend", "torch"),
                          1, "holds no text")
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"\xff\xfe\x00bad")
    assert_one_line_error(invoke("bench", model, "--prompt-file", binary, "--compare", "none", "--backend", "torch"),
                          1, "cannot read the prompt file")
