"""The artifact cache: hits, misses, damage, concurrency and interruption."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from linnet_core.backends import get_backend
from linnet_core.cache import ArtifactCache, CacheWarning, EntryInUse, cache_root
from linnet_core.compile import compile_model
from linnet_core.errors import CacheError
from linnet_core.weights import Checkpoint, write_safetensors


@pytest.fixture
def cache(tmp_path):
    return ArtifactCache(tmp_path / "cache")


@pytest.fixture
def model(checkpoints, tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(checkpoints["qwen2-bias-tied"], dst)
    return dst


def test_root_follows_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("LINNET_CACHE", str(tmp_path / "a"))
    assert cache_root() == tmp_path / "a"
    monkeypatch.delenv("LINNET_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "linnet"


def test_second_compile_is_a_hit(model, cache):
    first = compile_model(model, "torch", "float32", 32, cache=cache)
    second = compile_model(model, "torch", "float32", 32, cache=cache)
    assert (first.hit, second.hit) == (False, True)
    assert first.artifact == second.artifact
    assert {"model.py", "weights.safetensors", "manifest.json", "graph.json"} <= {p.name for p in first.artifact.iterdir()}


def test_key_covers_dtype_cache_len_and_backend_toolchain(model, cache, monkeypatch):
    base = compile_model(model, "torch", "float32", 32, cache=cache).artifact
    assert compile_model(model, "torch", "bfloat16", 32, cache=cache).artifact != base
    assert compile_model(model, "torch", "float32", 48, cache=cache).artifact != base
    monkeypatch.setattr(type(get_backend("torch")), "toolchain", lambda self: {"torch": "0.0-other"})
    assert not compile_model(model, "torch", "float32", 32, cache=cache).hit


def test_key_covers_the_sources_that_write_artifacts(model, cache, monkeypatch):
    """An edited emitter (a new source digest) misses the entries the old code made."""
    import linnet_core.cache as cache_module
    from linnet_core import sources

    assert all((sources.ROOT / entry).exists() for entry in sources.ARTIFACT_SOURCES)  # a rename drops no source
    assert set(sources.WEIGHT_SOURCES) <= set(sources.ARTIFACT_SOURCES)
    assert len(sources.artifact_sources_digest()) == 16
    compile_model(model, "torch", "float32", 32, cache=cache)
    monkeypatch.setattr(cache_module, "artifact_sources_digest", lambda: "edited-emitter")
    assert not compile_model(model, "torch", "float32", 32, cache=cache).hit


KEYS = ("from linnet_core.cache import ArtifactKey; from linnet_core.weight_store import WeightKey; "
        "print(WeightKey('m', 'q8_0', 'safetensors', 'f').digest, ArtifactKey('m', 'm', 'torch', 'q8_0', 32, ()).digest)")


@pytest.mark.parametrize("source", ["quant.py", "gguf/checkpoint.py", "params.py"])
def test_an_edited_weight_source_gets_new_keys(source, tmp_path):
    """A copy of Linnet whose quantizer, GGUF reader or weight layout differs by one comment keys its
    stored weights and its artifacts afresh: no version bump needed for a stale blob never to be reused."""
    import linnet_core

    installed = Path(linnet_core.__file__).parent
    copy = tmp_path / "linnet_core"
    shutil.copytree(installed, copy, ignore=shutil.ignore_patterns("__pycache__", "default_model"))

    def keys(package_parent: Path) -> list[str]:
        out = subprocess.run([sys.executable, "-c", KEYS], env={**os.environ, "PYTHONPATH": str(package_parent)},
                             capture_output=True, text=True, check=True, cwd=tmp_path).stdout.split()
        return out

    before = keys(tmp_path)
    assert before == keys(installed.parent)  # the copy alone changes nothing
    with (copy / source).open("a") as f:
        f.write("\n# an edit\n")
    after = keys(tmp_path)
    assert after[0] != before[0] and after[1] != before[1]


def test_changed_weights_miss(model, cache):
    first = compile_model(model, "torch", "float32", 32, cache=cache)
    ckpt = Checkpoint.from_folder(model)
    tensors = {n: ckpt.get(n).clone() for n in ckpt.tensors}
    tensors["model.norm.weight"] += 1  # same shapes, other numbers
    f = model / "model.safetensors"
    f.unlink()
    write_safetensors(f, [(n, tuple(t.shape), t.dtype) for n, t in tensors.items()], iter(tensors.values()))
    second = compile_model(model, "torch", "float32", 32, cache=cache)
    assert not second.hit and second.artifact != first.artifact


@pytest.mark.parametrize("damage", ["truncate-weights", "edit-code", "drop-manifest"])
def test_damaged_entry_is_rebuilt_with_a_warning(model, cache, damage):
    entry = compile_model(model, "torch", "float32", 32, cache=cache).artifact
    if damage == "truncate-weights":
        w = entry / "weights.safetensors"
        w.write_bytes(w.read_bytes()[:-64])
    elif damage == "edit-code":
        (entry / "model.py").write_text("raise SystemExit('tampered')\n")
    else:
        (entry / "manifest.json").unlink()
    with pytest.warns(CacheWarning, match="damaged"):
        again = compile_model(model, "torch", "float32", 32, cache=cache)
    assert not again.hit and again.artifact == entry
    assert compile_model(model, "torch", "float32", 32, cache=cache).hit
    assert "tampered" not in (entry / "model.py").read_text()


def test_interrupted_build_leaves_nothing(model, cache, monkeypatch):
    backend = type(get_backend("torch"))
    real = backend.compile

    def interrupted(self, graph, ckpt, dtype, cache_len, out, place):
        real(self, graph, ckpt, dtype, cache_len, out, place)
        raise KeyboardInterrupt

    monkeypatch.setattr(backend, "compile", interrupted)
    with pytest.raises(KeyboardInterrupt):
        compile_model(model, "torch", "float32", 32, cache=cache)
    assert list((cache.root / "artifacts").iterdir()) == []
    assert list((cache.root / "tmp").iterdir()) == []


def test_leftovers_of_a_killed_build_are_swept_by_their_lock_not_a_pid(model, cache):
    """A build holds its key's lock to the end: a folder whose lock is free is abandoned; one whose
    lock is held (a build on another host or container, whose PID means nothing here) stays."""
    from linnet_core.file_locks import try_exclusive

    stale = cache.root / "tmp" / f"{'a' * 32}.deadbeef"
    live = cache.root / "tmp" / f"{'b' * 32}.cafef00d"
    for d in (stale, live):
        d.mkdir(parents=True)
    (cache.root / "locks").mkdir(exist_ok=True)
    held = try_exclusive(cache.root / "locks" / f"{'b' * 32}.lock")  # a builder elsewhere
    try:
        compile_model(model, "torch", "float32", 32, cache=cache)
        assert not stale.exists() and live.exists()
    finally:
        os.close(held)


def test_two_processes_compiling_one_key_both_succeed(model, tmp_path):
    root = tmp_path / "shared-cache"
    script = textwrap.dedent(f"""
        import json, sys
        from linnet_core.cache import ArtifactCache
        from linnet_core.compile import compile_model
        c = compile_model({str(model)!r}, "torch", "float32", 32, cache=ArtifactCache({str(root)!r}))
        print(json.dumps({{"path": str(c.artifact), "hit": c.hit}}))
    """)
    procs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    results = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), results
    import json

    outs = [json.loads(o.strip().splitlines()[-1]) for o, _ in results]
    assert outs[0]["path"] == outs[1]["path"]
    assert sorted(o["hit"] for o in outs) == [False, True]  # built once, found once
    assert len(list((root / "artifacts").iterdir())) == 1


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write anywhere")
def test_unwritable_cache_is_a_clear_error(model, tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    with pytest.raises(CacheError, match="not writable"):
        compile_model(model, "torch", "float32", 32, cache=ArtifactCache(ro / "c"))


def test_cache_under_a_file_is_a_clear_error(model, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(CacheError, match="not writable"):
        compile_model(model, "torch", "float32", 32, cache=ArtifactCache(blocker / "c"))


# --- weights stored once ------------------------------------------------------------------------

def _inode(path):
    st = path.stat()
    return st.st_dev, st.st_ino


def test_cache_lengths_and_backends_share_one_stored_copy(model, cache):
    """Two cache lengths of torch and one of jax link one safetensors blob; ONNX Runtime's two link
    one data file of their own layout. A second cache length adds kilobytes."""
    import importlib.util

    first = compile_model(model, "torch", "float32", 32, cache=cache)
    second = compile_model(model, "torch", "float32", 48, cache=cache)
    weights = first.artifact / "weights.safetensors"
    assert _inode(weights) == _inode(second.artifact / "weights.safetensors")
    blobs = cache.store.blobs()
    assert len(blobs) == 1 and blobs[0].users == 2
    by_name = {e.path: e for e in cache.entries()}
    assert by_name[second.artifact].size < 100_000 < weights.stat().st_size  # own files only
    assert by_name[second.artifact].shared == (blobs[0].path.name,)
    if importlib.util.find_spec("jax"):
        jax = compile_model(model, "jax", "float32", 32, cache=cache)
        assert _inode(jax.artifact / "weights.safetensors") == _inode(weights)
    if importlib.util.find_spec("onnxruntime"):
        a = compile_model(model, "onnxruntime", "float32", 32, cache=cache)
        b = compile_model(model, "onnxruntime", "float32", 48, cache=cache)
        assert _inode(a.artifact / "model.onnx.data") == _inode(b.artifact / "model.onnx.data")
        assert len(cache.store.blobs()) == 2


def test_removing_one_user_keeps_the_others_working(model, cache):
    from linnet_core.compile import load_model

    first = compile_model(model, "torch", "float32", 32, cache=cache)
    second = compile_model(model, "torch", "float32", 48, cache=cache)
    entry = next(e for e in cache.entries() if e.path == first.artifact)
    assert cache.freed_with([entry]) == []  # the other entry still uses the weights
    first.lease.release()  # this process is done with it
    cache.remove(entry)
    assert len(cache.store.blobs()) == 1
    session, again = load_model(model, "torch", "float32", 48, cache=cache)
    assert again.hit and again.artifact == second.artifact
    assert session.prefill([1, 2, 3]).tokens
    last = next(e for e in cache.entries() if e.path == second.artifact)
    assert [b.path for b in cache.freed_with([last])] == [cache.store.blobs()[0].path]
    with pytest.raises(EntryInUse):  # the session still reads it
        cache.remove(last)
    assert last.path.is_dir()
    del session
    again.lease.release()
    second.lease.release()
    cache.remove(last)
    assert cache.store.blobs() == []  # the last user gone, so are the weights


def test_prune_keeps_weights_in_use_and_drops_unused_ones(model, cache):
    compile_model(model, "torch", "float32", 32, cache=cache)
    compile_model(model, "torch", "float32", 48, cache=cache)
    old = next(e for e in cache.entries() if e.cache_len == 32)
    os.utime(old.path / "manifest.json", (1, 1))  # last used long ago
    gone = cache.prune(older_than_s=3600)
    assert [e.cache_len for e in gone] == [32]
    assert len(cache.store.blobs()) == 1 and cache.store.blobs()[0].users == 1
    assert cache.prune(max_bytes=1)  # nothing fits: the last entry goes, and its weights with it
    assert cache.store.blobs() == [] and cache.entries() == []


def test_a_written_blob_leaves_the_page_cache_to_come_back_in_huge_pages(model, cache, monkeypatch):
    """The store drops each blob it writes from the page cache (its small pages), once, complete:
    the first session maps it with MADV_HUGEPAGE and reads it back in 2 MiB pages. ONNX Runtime
    reads its own data file, so that blob stays cached."""
    import importlib.util

    from linnet_core import weight_store

    dropped = []
    monkeypatch.setattr(weight_store, "drop_cached", lambda path: dropped.append((path.name, path.stat().st_size)))
    first = compile_model(model, "torch", "float32", 32, cache=cache)
    compile_model(model, "torch", "float32", 40, cache=cache)  # linked, not written: nothing to drop
    if importlib.util.find_spec("onnxruntime"):
        compile_model(model, "onnxruntime", "float32", 32, cache=cache)
    assert len(dropped) == 1 and dropped[0][1] == (first.artifact / "weights.safetensors").stat().st_size


def test_damaged_shared_weights_are_rebuilt(model, cache):
    first = compile_model(model, "torch", "float32", 32, cache=cache)
    blob = cache.store.blobs()[0].path
    with open(blob, "r+b") as f:  # a half-written blob, as a killed writer would leave it
        f.truncate(blob.stat().st_size // 2)
    with pytest.warns(CacheWarning, match="damaged"):
        again = compile_model(model, "torch", "float32", 32, cache=cache)
    assert not again.hit and cache.store.intact(blob)
    assert _inode(again.artifact / "weights.safetensors") == _inode(blob)
    assert compile_model(model, "torch", "float32", 48, cache=cache).artifact != first.artifact
    assert len(cache.store.blobs()) == 1


def test_concurrent_compiles_of_two_cache_lengths_write_one_blob(model, tmp_path):
    root = tmp_path / "shared-cache"
    script = textwrap.dedent(f"""
        import sys
        from linnet_core.cache import ArtifactCache
        from linnet_core.compile import compile_model
        compile_model({str(model)!r}, "torch", "float32", int(sys.argv[1]), cache=ArtifactCache({str(root)!r}))
    """)
    procs = [subprocess.Popen([sys.executable, "-c", script, str(n)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for n in (32, 48)]
    results = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), results
    cache = ArtifactCache(root)
    assert len(cache.entries()) == 2
    blobs = cache.store.blobs()
    assert len(blobs) == 1 and blobs[0].users == 2
    assert not [p for p in (root / "weights").iterdir() if p.name.startswith(".")]  # no temporary left
