"""Model resolution: folders, repo ids and short names through a Hugging Face cache, offline."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from linnet_core.errors import ModelNotFound
from linnet_core.hub import DEFAULT_MODEL_DIR, SHORT_NAMES, resolve

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def place_in_hf_cache(hf_home: Path, repo_id: str, folder: Path, revision: str = "main", commit: str = COMMIT) -> Path:
    """Lay a checkpoint out the way huggingface_hub caches it (blobs, snapshots, refs)."""
    repo = hf_home / "hub" / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / commit
    blobs = repo / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir(exist_ok=True)
    for f in folder.iterdir():
        import hashlib

        digest = hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copy(f, blobs / digest)
        (snap / f.name).symlink_to(Path("../../blobs") / digest)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / revision).write_text(commit)
    return snap


@pytest.fixture
def hf_home(tmp_path, monkeypatch):
    home = tmp_path / "hf"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return home


def test_local_folder(checkpoints):
    r = resolve(str(checkpoints["qwen3-headdim128"]))
    assert r.path == checkpoints["qwen3-headdim128"] and r.repo_id is None


def test_none_is_the_embedded_model():
    assert resolve(None).path == DEFAULT_MODEL_DIR


def test_short_name_resolves_through_the_hf_cache(hf_home, checkpoints):
    snap = place_in_hf_cache(hf_home, SHORT_NAMES["qwen3-4b"], checkpoints["qwen3-headdim128"])
    r = resolve("qwen3-4b")
    assert r.path == snap and r.repo_id == "Qwen/Qwen3-4B"


def test_repo_id_and_revision(hf_home, checkpoints):
    other = "fedcba9876543210fedcba9876543210fedcba98"
    place_in_hf_cache(hf_home, "someone/tiny", checkpoints["llama-gqa-untied"])
    snap2 = place_in_hf_cache(hf_home, "someone/tiny", checkpoints["phi3-fused-window"], revision="v2", commit=other)
    assert resolve("someone/tiny").path.name == COMMIT
    assert resolve("someone/tiny", revision="v2").path == snap2


def test_missing_model_says_how_to_fetch_it(hf_home):
    with pytest.raises(ModelNotFound) as e:
        resolve("mistral-7b-instruct-v0.3")
    assert "mistralai/Mistral-7B-Instruct-v0.3" in e.value.message
    assert "\n" not in e.value.message
    assert e.value.hint.startswith("fetch it with: hf download mistralai/Mistral-7B-Instruct-v0.3")


@pytest.mark.parametrize("name", ["./nope", "no such thing", "a/b/c"])
def test_unknown_names(name, hf_home):
    with pytest.raises(ModelNotFound):
        resolve(name)


def test_a_file_is_not_a_model(tmp_path):
    f = tmp_path / "model.safetensors"
    f.write_bytes(b"")
    with pytest.raises(ModelNotFound, match="is a file"):
        resolve(str(f))
