"""The CLI as scripts meet it: exit codes, --json on stdout, one-line errors, no tracebacks."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from linnet_cli.app import app

runner = CliRunner()


def invoke(*args, env=None):
    return runner.invoke(app, [str(a) for a in args], env=env)


def assert_one_line_error(result, code=1, contains=""):
    assert result.exit_code == code, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr + result.stdout
    lines = [l for l in result.stderr.splitlines() if l.strip()]
    errors = [l for l in lines if l.startswith("error:")] or [l for l in lines if "Error" in l or "Invalid" in l]
    assert len(errors) == 1, result.stderr
    assert contains in result.stderr
    return errors


def test_version():
    r = invoke("--version")
    assert r.exit_code == 0 and r.stdout.startswith("linnet 0.")


def test_compile_prints_path_hit_and_time(checkpoints):
    path = checkpoints["phi3-fused-window"]
    first = invoke("compile", path, "--dtype", "bf16", "--cache-len", "40", "--json")  # spellings people type
    assert first.exit_code == 0, first.stderr
    data = json.loads(first.stdout)
    assert os.path.isdir(data["artifact"]) and data["dtype"] == "bfloat16" and data["cache_len"] == 40
    second = invoke("compile", path, "--dtype", "bfloat16", "--cache-len", "40")
    assert second.exit_code == 0
    assert data["artifact"] in second.stdout and "cache hit" in second.stdout
    assert json.loads(invoke("compile", path, "--dtype", "bfloat16", "--cache-len", "40", "--json").stdout)["hit"]


def test_verify_json_and_exit_code(checkpoints, monkeypatch):
    path = checkpoints["qwen3-headdim128"]
    ok = invoke("verify", path, "--steps", "8", "--json")
    assert ok.exit_code == 0, ok.stderr
    report = json.loads(ok.stdout)
    assert report["passed"] and report["distance"] <= 1e-4 and report["steps"] == 8
    assert report["tokens_match"] and report["top1_agreement"] == 1.0
    human = invoke("verify", path, "--dtype", "float16")
    assert human.exit_code == 0 and "PASS" in human.stdout and "distance from reference" in human.stdout

    import linnet_core.check.agreement as v

    monkeypatch.setitem(v.TOLERANCE, "float16", 0.0)  # nothing passes a zero tolerance in float16
    failed = invoke("verify", path, "--dtype", "float16", "--json")
    assert failed.exit_code == 3  # its own code: wrong numbers, not a failure to run
    assert json.loads(failed.stdout)["passed"] is False


def test_run_streams_text_and_reports_timing_on_stderr(checkpoints):
    r = invoke("run", "--prompt", "The function returns", "--max-new-tokens", "12")
    assert r.exit_code == 0, r.stderr
    assert r.stdout.strip()
    assert "tok/s" in r.stderr and "first token" in r.stderr


def test_run_json_chat_and_sampling():
    r = invoke("run", "-p", "What is a list?", "--chat", "-n", "8", "--temperature", "0.8", "--top-p", "0.9",
               "--top-k", "40", "--seed", "3", "--json")
    assert r.exit_code == 0, r.stderr
    data = json.loads(r.stdout)
    assert 1 <= data["new_tokens"] <= 8 and data["finish_reason"] in ("length", "stop")
    again = json.loads(invoke("run", "-p", "What is a list?", "--chat", "-n", "8", "--temperature", "0.8",
                              "--top-p", "0.9", "--top-k", "40", "--seed", "3", "--json").stdout)
    assert again["tokens"] == data["tokens"]


def test_run_holds_the_output_to_a_schema_a_regex_or_a_grammar(tmp_path):
    import re

    schema = tmp_path / "s.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                                         "maximum": 99}, "ok": {"type": "boolean"}},
                                  "required": ["n", "ok"], "additionalProperties": False}))
    r = invoke("run", "-p", "Answer:", "-n", "40", "--json-schema", schema, "--logprobs", "2", "--json")
    assert r.exit_code == 0, r.stderr
    data = json.loads(r.stdout)
    answer = json.loads(data["text"])
    assert set(answer) == {"n", "ok"} and 0 <= answer["n"] <= 99 and data["finish_reason"] == "stop"
    assert len(data["logprobs"]) == data["new_tokens"] and all(lp["logprob"] <= 0 for lp in data["logprobs"])
    assert all(lp["top"][0]["token"] == lp["token"] for lp in data["logprobs"])  # greedy: the likeliest
    r = invoke("run", "-p", "Code:", "-n", "10", "--regex", "[A-Z]{2}-[0-9]{3}", "--json")
    assert re.fullmatch("[A-Z]{2}-[0-9]{3}", json.loads(r.stdout)["text"]), r.stdout
    gbnf = tmp_path / "g.gbnf"
    gbnf.write_text('root ::= ("yes" | "no") "." ')
    r = invoke("run", "-p", "Well?", "-n", "10", "--grammar", gbnf, "--json")
    assert json.loads(r.stdout)["text"] in ("yes.", "no."), r.stdout
    r = invoke("run", "-p", "x", "--regex", "[a-")
    assert_one_line_error(r, 1, "regex cannot be compiled")
    r = invoke("run", "-p", "x", "--json-schema", tmp_path / "missing.json")
    assert_one_line_error(r, 1, "cannot be read")
    r = invoke("run", "-p", "x", "--regex", "a", "--grammar", gbnf)
    assert_one_line_error(r, 1, "give one")


def test_prompt_longer_than_cache_is_a_clear_error():
    r = invoke("run", "-p", "word " * 200, "--cache-len", "64")
    assert_one_line_error(r, 1, "cache holds 64 positions")


@pytest.mark.parametrize("args,code,text", [
    (["compile", "no-such-model-anywhere"], 1, "no model 'no-such-model-anywhere'"),
    (["compile", "Qwen/Qwen3-4B"], 1, "hf download Qwen/Qwen3-4B"),
    (["compile", "/definitely/missing/folder"], 1, "no model"),
    (["compile", "{fixture}", "--backend", "nonsense"], 2, "nonsense"),
    (["compile", "{fixture}", "--dtype", "float8"], 2, "float8"),
    (["verify", "{fixture}", "--steps", "0"], 2, "steps"),
])
def test_bad_input_is_one_line_and_an_exit_code(args, code, text, checkpoints, tmp_path, monkeypatch):
    monkeypatch.setenv("LINNET_CACHE", str(tmp_path / "c"))
    args = [a.replace("{fixture}", str(checkpoints["llama-gqa-untied"])) for a in args]
    r = invoke(*args)
    assert_one_line_error(r, code, text)
    assert not (tmp_path / "c" / "artifacts").exists() or not any((tmp_path / "c" / "artifacts").iterdir())


def test_unsupported_architecture_and_pickle(tmp_path, checkpoints):
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    lines = assert_one_line_error(invoke("compile", gpt2), 1, "model_type 'gpt2' is not supported")
    assert "qwen3" in lines[0]
    pickled = tmp_path / "pickled"
    shutil.copytree(checkpoints["llama-gqa-untied"], pickled)
    (pickled / "model.safetensors").rename(pickled / "pytorch_model.bin")
    assert_one_line_error(invoke("compile", pickled), 1, "never loaded")


def test_unwritable_cache(checkpoints, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    r = invoke("compile", checkpoints["llama-gqa-untied"], env={"LINNET_CACHE": str(blocker / "cache")})
    assert_one_line_error(r, 1, "not writable")


def test_debug_shows_the_traceback(tmp_path):
    """LINNET_DEBUG=1 shows the whole traceback, in a real process (what a user would paste)."""
    env = {**os.environ, "LINNET_DEBUG": "1", "LINNET_CACHE": str(tmp_path / "c")}
    r = subprocess.run([sys.executable, "-m", "linnet_cli", "compile", str(tmp_path / "nothing-here")],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode != 0
    assert "Traceback (most recent call last)" in r.stderr and "ModelNotFound" in r.stderr
    quiet = subprocess.run([sys.executable, "-m", "linnet_cli", "compile", str(tmp_path / "nothing-here")],
                           capture_output=True, text=True, env={**env, "LINNET_DEBUG": "0"}, timeout=120)
    assert quiet.returncode != 0 and "Traceback" not in quiet.stderr


def test_console_script_in_a_real_process(checkpoints, tmp_path):
    """What a CI script sees: `python -m linnet_cli verify ... || exit 1`."""
    env = {**os.environ, "LINNET_CACHE": str(tmp_path / "c")}
    ok = subprocess.run([sys.executable, "-m", "linnet_cli", "verify", str(checkpoints["mistral-window"]), "--json"],
                        capture_output=True, text=True, env=env, timeout=300)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["passed"]
    bad = subprocess.run([sys.executable, "-m", "linnet_cli", "run", "nope/nope", "-p", "x"],
                         capture_output=True, text=True, env={**env, "HF_HUB_OFFLINE": "1"}, timeout=300)
    assert bad.returncode == 1 and "Traceback" not in bad.stderr
    assert bad.stderr.startswith("error: model 'nope/nope' is not in the local Hugging Face cache")


def test_completions_and_man_page_are_current():
    """They are generated from the app: `python -m linnet_cli.docs` after changing a command."""
    from linnet_cli.docs import main

    assert main(["--check"]) == 0


def test_short_name_from_a_local_hf_cache_offline(checkpoints, tmp_path):
    """`linnet verify qwen3-4b` with the checkpoint in HF_HOME's cache layout and no network."""
    from test_hub import place_in_hf_cache

    place_in_hf_cache(tmp_path / "hf", "Qwen/Qwen3-4B", checkpoints["qwen3-headdim128"])
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    r = invoke("verify", "qwen3-4b", "--json", env=env)
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["passed"]
    c = json.loads(invoke("compile", "qwen3-4b", "--dtype", "bfloat16", "--json", env=env).stdout)
    assert c["model"] == "qwen3-4b" and c["model_type"] == "qwen3"
