"""`doctor`, `models`, `cache ls|rm|prune|path`, and the output contract every command keeps."""

from __future__ import annotations

import json
import os
import time

import pytest
from test_cli import assert_one_line_error, invoke

from linnet_core.backends import BACKEND_NAMES
from linnet_core.models.catalog import CATALOG


def test_doctor_reports_every_backend(monkeypatch, tmp_path):
    monkeypatch.setenv("LINNET_CACHE", str(tmp_path / "c"))
    r = invoke("doctor", "--json")
    assert r.exit_code == 0, r.stderr
    data = json.loads(r.stdout)
    backends = {c["name"]: c for c in data["backends"]}
    assert set(backends) == set(BACKEND_NAMES)
    assert backends["torch"]["ready"]
    for c in data["backends"] + data["packages"] + data["platform"]:
        assert c["detail"] and "\n" not in c["detail"]
        if not c["ready"] and c["name"] in ("tensorrt", "TensorRT", "JAX", "ONNX Runtime"):
            assert c["fix"] and "pip install" in c["fix"]
    names = {c["name"] for c in data["platform"]}
    assert {"Python", "PyTorch", "GPU", "artifact cache"} <= names
    ray = next(c for c in data["packages"] if c["name"] == "Ray Serve (serve --ray)")
    assert ray["ready"] or ray["fix"] == "pip install 'linnet[ray]'"
    shared = json.loads(invoke("doctor", "--json", env={"LINNET_ARTIFACT_STORE": str(tmp_path / "s")}).stdout)
    cache = next(c for c in shared["platform"] if c["name"] == "artifact cache")
    assert f"shared store {tmp_path / 's'}" in cache["detail"]
    human = invoke("doctor")
    assert human.exit_code == 0 and "backends" in human.stdout and "ready" in human.stdout


def test_models_lists_the_catalog_and_what_is_cached(checkpoints, tmp_path):
    from test_hub import place_in_hf_cache

    place_in_hf_cache(tmp_path / "hf", "Qwen/Qwen3-4B", checkpoints["qwen3-headdim128"])
    r = invoke("models", "--json", env={"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"})
    assert r.exit_code == 0, r.stderr
    rows = {m["name"]: m for m in json.loads(r.stdout)["models"]}
    assert set(rows) == set(CATALOG)
    assert rows["qwen3-4b"]["cached"] and rows["qwen3-4b"]["model_type"] == "qwen3"
    assert not rows["qwen3-0.6b"]["cached"]
    assert "Qwen/Qwen3-4B" in invoke("models", env={"HF_HOME": str(tmp_path / "hf")}).stdout


@pytest.fixture
def filled_cache(checkpoints, tmp_path, monkeypatch):
    """A cache with three torch entries (f32, bf16, f16), last used 40 days, 10 days and just now ago."""
    monkeypatch.setenv("LINNET_CACHE", str(tmp_path / "cache"))
    path = checkpoints["qwen2-bias-tied"]
    made = []
    for dtype in ("float32", "bfloat16", "float16"):
        r = invoke("compile", path, "--backend", "torch", "--dtype", dtype, "--cache-len", "24", "--json")
        assert r.exit_code == 0, r.stderr
        made.append(json.loads(r.stdout)["artifact"])
    now = time.time()
    for age_days, artifact in zip((40, 10, 0), made, strict=True):
        os.utime(os.path.join(artifact, "manifest.json"), (now - age_days * 86400,) * 2)
    return tmp_path / "cache", made


def test_cache_path_and_ls(filled_cache):
    root, made = filled_cache
    assert invoke("cache", "path").stdout.strip() == str(root)
    r = invoke("cache", "ls", "--json")
    assert r.exit_code == 0
    data = json.loads(r.stdout)
    assert [e["path"] for e in data["entries"]] == made[::-1]  # most recently used first
    first = data["entries"][0]
    assert first["backend"] == "torch" and first["cache_len"] == 24 and first["bytes"] > 0 and first["intact"]
    # Each entry's own files, then each stored weights file once (one per dtype here) with its user.
    assert data["bytes"] == sum(e["bytes"] for e in data["entries"]) + sum(w["bytes"] for w in data["shared_weights"])
    assert sorted(w["used_by"] for w in data["shared_weights"]) == sorted([os.path.basename(m)] for m in made)
    assert all(len(e["shared_weights"]) == 1 for e in data["entries"])
    human = invoke("cache", "ls").stdout
    assert "qwen2-bias-tied" in human and "3 entries" in human and "40d ago" in human
    assert "3 stored weights" in human and "stored weights (shared)" in human


def test_cache_prune_by_age_and_size(filled_cache):
    root, made = filled_cache
    dry = json.loads(invoke("cache", "prune", "--older-than", "30d", "--dry-run", "--json").stdout)
    assert [e["path"] for e in dry["removed"]] == [made[0]] and os.path.isdir(made[0])
    r = invoke("cache", "prune", "--older-than", "30d")
    assert r.exit_code == 0 and "removed 1 entries" in r.stdout and not os.path.exists(made[0])
    ls = json.loads(invoke("cache", "ls", "--json").stdout)
    newest = os.path.basename(made[2])
    room = next(e["bytes"] for e in ls["entries"] if e["path"] == made[2]) \
        + next(w["bytes"] for w in ls["shared_weights"] if w["used_by"] == [newest])
    r = invoke("cache", "prune", "--max-size", str(room), "--json")  # room for one: the newest stays
    assert [e["path"] for e in json.loads(r.stdout)["removed"]] == [made[1]]
    assert os.path.isdir(made[2]) and not os.path.exists(made[1])


def test_cache_rm_and_damaged_entries(filled_cache):
    root, made = filled_cache
    (root / "artifacts" / "broken-entry").mkdir()
    ls = json.loads(invoke("cache", "ls", "--json").stdout)["entries"]
    assert [e["intact"] for e in ls].count(False) == 1
    r = invoke("cache", "rm", os.path.basename(made[1]), "--json")
    assert r.exit_code == 0 and len(json.loads(r.stdout)["removed"]) == 1 and not os.path.exists(made[1])
    pruned = json.loads(invoke("cache", "prune", "--older-than", "1000d", "--json").stdout)["removed"]
    assert [e["name"] for e in pruned] == ["broken-entry"]  # damaged entries always go
    assert invoke("cache", "rm", "qwen2-bias-tied", "--backend", "torch").exit_code == 0
    assert json.loads(invoke("cache", "ls", "--json").stdout)["entries"] == []
    assert not any((root / "trash").iterdir())


@pytest.mark.parametrize("args,code,text", [
    (["cache", "rm"], 1, "say what to remove"),
    (["cache", "rm", "no-such-entry"], 1, "no cache entry matches no-such-entry"),
    (["cache", "prune"], 1, "say what to prune"),
    (["cache", "prune", "--older-than", "soon"], 1, "cannot read 'soon' as a duration"),
    (["cache", "prune", "--max-size", "big"], 1, "cannot read 'big' as a size"),
    (["doctor", "--frobnicate"], 2, "frobnicate"),
    (["models", "extra-arg"], 2, "extra-arg"),
    (["serve", "--replicas", "2"], 1, "--replicas: for a deployment on Ray; add --ray"),
    (["serve", "--model", "a", "--ray-address", "auto"], 1, "--ray-address, --model: for a deployment on Ray"),
    (["serve", "--ray", "--ray-address", "qwen3-4b"], 1, "--ray-address is auto, HOST:PORT or ray://HOST:PORT"),
    (["serve", "--ray", "--join", "--replicas", "3"], 1, "--replicas: set by the command that deployed the replicas"),
])
def test_admin_errors_are_one_line(args, code, text, tmp_path, monkeypatch):
    monkeypatch.setenv("LINNET_CACHE", str(tmp_path / "c"))
    assert_one_line_error(invoke(*args), code, text)


def test_serve_ray_without_ray_names_the_extra(monkeypatch, tmp_path):
    import sys

    import linnet_core.serve

    monkeypatch.setenv("LINNET_CACHE", str(tmp_path / "c"))
    monkeypatch.setitem(sys.modules, "ray", None)  # as where Ray is not installed
    for name in [m for m in sys.modules if m.startswith("linnet_core.serve.ray_")]:  # imported by an earlier test
        monkeypatch.delitem(sys.modules, name)
        monkeypatch.delattr(linnet_core.serve, name.rsplit(".", 1)[1], raising=False)
    r = invoke("serve", "--ray")
    assert_one_line_error(r, 1, "linnet serve --ray needs ray, which is not installed")
    assert "pip install 'linnet[ray]'" in r.stderr


@pytest.mark.parametrize("command", [
    ["compile", "--help"], ["run", "--help"], ["verify", "--help"], ["bench", "--help"], ["doctor", "--help"],
    ["models", "--help"], ["cache", "ls", "--help"], ["cache", "rm", "--help"], ["cache", "prune", "--help"],
    ["cache", "path", "--help"], ["export", "onnx", "--help"], ["export", "hf", "--help"],
    ["export", "gguf", "--help"],
])
def test_every_command_has_json_and_quiet(command):
    text = invoke(*command).stdout
    assert "--json" in text and "--quiet" in text, command


@pytest.mark.parametrize("args,code,text", [
    (["run", "no-such-model", "-p", "x"], 1, "no model 'no-such-model'"),
    (["verify", "/missing/folder"], 1, "no model"),
    (["bench", "/missing/folder", "--runs", "1"], 1, "no model"),
    (["export", "hf", "/missing/folder", "{tmp}/o"], 1, "no model"),
    (["export", "gguf", "{fixture}", "{tmp}/o.gguf", "--dtype", "q2"], 2, "q2"),
    (["export", "onnx", "{fixture}", "{tmp}/o", "--dtype", "float8"], 2, "float8"),
    (["run", "{fixture}", "-p", "x", "--backend", "tpu"], 2, "tpu"),
    (["bench", "{fixture}", "--backend", "tpu"], 1, "unknown backend 'tpu'"),
])
def test_bad_input_everywhere_leaves_the_cache_empty(args, code, text, checkpoints, tmp_path, monkeypatch):
    monkeypatch.setenv("LINNET_CACHE", str(tmp_path / "c"))
    args = [a.replace("{fixture}", str(checkpoints["llama-gqa-untied"])).replace("{tmp}", str(tmp_path))
            for a in args]
    assert_one_line_error(invoke(*args, env={"HF_HUB_OFFLINE": "1"}), code, text)
    artifacts = tmp_path / "c" / "artifacts"
    assert not artifacts.exists() or not any(artifacts.iterdir())
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.gguf").exists()


def test_no_color_when_piped_or_asked(checkpoints, tmp_path, monkeypatch):
    monkeypatch.setenv("LINNET_CACHE", str(tmp_path / "c"))
    for env in ({}, {"NO_COLOR": "1"}):
        r = invoke("doctor", env=env)
        assert "\x1b[" not in r.stdout + r.stderr


def assert_hint_follows(stderr: str) -> None:
    lines = stderr.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("error:"))
    assert lines[at + 1].startswith("hint:") and len(lines[at + 1]) > 8, stderr


COMMANDS = {  # each command as a script would call it, with MODEL and OUT to fill in
    "compile": ["compile", "MODEL"], "run": ["run", "MODEL", "-p", "Hello"], "verify": ["verify", "MODEL"],
    "bench": ["bench", "MODEL", "--runs", "1", "--warmups", "0", "--compare", "none", "--backend", "torch"],
    "export onnx": ["export", "onnx", "MODEL", "OUT"], "export hf": ["export", "hf", "MODEL", "OUT"],
    "export gguf": ["export", "gguf", "MODEL", "OUT"],
}
BAD = {  # what is wrong -> (what to change, exit code, what the line says)
    "unknown model": ({"MODEL": "no-such-model"}, 1, "no model 'no-such-model'"),
    "missing folder": ({"MODEL": "/no/such/folder"}, 1, "no model '/no/such/folder'"),
    "bad dtype": ({"--dtype": "float8"}, 2, "float8"),
    "bad backend": ({"--backend": "tpu"}, None, "tpu"),
    "unwritable cache": ({"LINNET_CACHE": "/proc/linnet-cache"}, 1, "not writable"),
}


# Exports take no backend and do not use the artifact cache: those pairs do not apply.
PAIRS = [(c, b) for c in COMMANDS for b in BAD
         if not (c.startswith("export") and b in ("bad backend", "unwritable cache"))]


@pytest.mark.parametrize("command,bad", PAIRS)
def test_every_command_with_bad_input(command, bad, tokenized_checkpoints, tmp_path, monkeypatch):
    change, code, text = BAD[bad]
    args = list(COMMANDS[command])
    monkeypatch.setenv("LINNET_CACHE", change.get("LINNET_CACHE", str(tmp_path / "c")))
    model = change.get("MODEL", str(tokenized_checkpoints["llama-gqa-untied"]))
    args = [model if a == "MODEL" else str(tmp_path / "out") if a == "OUT" else a for a in args]
    for flag in ("--dtype", "--backend"):
        if flag in change:
            if flag in args:
                args[args.index(flag) + 1] = change[flag]
            else:
                args += [flag, change[flag]]
    if "--backend" in change:  # a Typer choice (2), except bench, which takes lists (1)
        code = 1 if command == "bench" else 2
    if "--dtype" in change and command == "export gguf":
        text = "float8"  # its own GGUF types: still a usage error naming the value
    r = invoke(*args, env={"HF_HUB_OFFLINE": "1"})
    lines = assert_one_line_error(r, code, text)
    if code == 1:  # a LinnetError: its line, then a hint
        assert_hint_follows(r.stderr)
    artifacts = tmp_path / "c" / "artifacts"
    assert not artifacts.exists() or not any(artifacts.iterdir()), lines
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", ["run", "verify"])
def test_prompt_too_long_for_the_cache(command, tokenized_checkpoints, tmp_path, monkeypatch):
    monkeypatch.setenv("LINNET_CACHE", str(tmp_path / "c"))
    r = invoke(command, tokenized_checkpoints["llama-gqa-untied"], "--prompt", "word " * 300, "--cache-len", "32")
    assert_one_line_error(r, 1, "32")
    assert "prompt" in r.stderr
    assert_hint_follows(r.stderr)
