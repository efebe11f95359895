"""The shared artifact store: what one machine compiles, another fetches instead of compiling, checked
against the manifest as a local entry is; a damaged or hostile store entry is compiled here instead."""

from __future__ import annotations

import json

import pytest

from linnet_core.artifact_store import SharedStore, StoreWarning
from linnet_core.cache import ArtifactCache, CacheWarning
from linnet_core.compile import compile_model, load_model
from linnet_core.runtime.generate import Generation

CASE = "qwen3-headdim128"


def _compile(path, root, store, progress=None):
    return compile_model(path, "torch", "float32", 64, cache=ArtifactCache(root, SharedStore(str(store))),
                         progress=progress)


def test_a_second_machine_fetches_what_the_first_compiled(checkpoints, tmp_path):
    store = tmp_path / "store"
    first = _compile(checkpoints[CASE], tmp_path / "a", store)
    assert not first.hit and (store / "artifacts" / first.artifact.name / "manifest.json").is_file()
    said = []
    second = _compile(checkpoints[CASE], tmp_path / "b", f"file://{store}", said.append)
    assert second.hit and second.artifact.parent == tmp_path / "b" / "artifacts"
    assert any("came compiled from the artifact store" in s for s in said) and not any("compiling" in s for s in said)
    a, _ = load_model(checkpoints[CASE], "torch", "float32", 64, cache=ArtifactCache(tmp_path / "a"))
    b, _ = load_model(checkpoints[CASE], "torch", "float32", 64,
                      cache=ArtifactCache(tmp_path / "b", SharedStore(str(store))))
    assert list(Generation(a, [1, 2, 3], 8)) == list(Generation(b, [1, 2, 3], 8))


def test_a_damaged_store_entry_is_compiled_here(checkpoints, tmp_path):
    store = tmp_path / "store"
    first = _compile(checkpoints[CASE], tmp_path / "a", store)
    published = store / "artifacts" / first.artifact.name
    code = next(p for p in published.rglob("*.py"))
    code.write_text(code.read_text() + "\nimport os  # not what was compiled\n")
    with pytest.warns(CacheWarning, match="damaged"):
        second = _compile(checkpoints[CASE], tmp_path / "b", store)
    assert not second.hit  # compiled here, from the checkpoint


def test_a_manifest_naming_files_outside_its_entry_is_refused(tmp_path):
    entry = tmp_path / "store" / "artifacts" / "x"
    entry.mkdir(parents=True)
    (entry / "manifest.json").write_text(json.dumps({"digest": "d", "files": {"../../../escape": {"size": 1}}}))
    dest = tmp_path / "dest"
    dest.mkdir()
    with pytest.warns(StoreWarning, match="outside its entry"):
        assert not SharedStore(str(tmp_path / "store")).fetch("x", "d", dest)
    assert not (tmp_path / "escape").exists()
    assert not SharedStore(str(tmp_path / "store")).fetch("x", "other digest", dest)  # another key's: not taken
    assert not SharedStore(str(tmp_path / "store")).fetch("missing", "d", dest)


def test_an_unknown_store_protocol_is_one_line():
    from linnet_core.errors import InputError

    with pytest.raises(InputError, match="cannot open the artifact store"):
        SharedStore("nosuchprotocol://bucket/x")
