"""What an attacker or an operator meets (issue 18): a cache only its owner can write, removals that
never pull an entry from under a user, and checkpoint, export and disk edge cases as one line."""

from __future__ import annotations

import errno
import json
import os
import shutil
import struct
import subprocess
import sys
import textwrap

import pytest

from linnet_core.cache import ArtifactCache
from linnet_core.compile import compile_model, load_model
from linnet_core.errors import CacheError, CheckpointError, InputError
from linnet_core.models import spec_from_config
from linnet_core.weights import read_header

CASE = "qwen2-bias-tied"


@pytest.fixture
def model(checkpoints, tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(checkpoints[CASE], dst)
    return dst


def cli(*args, cache=None, **kw):
    env = {**os.environ, **({"LINNET_CACHE": str(cache)} if cache else {})}
    return subprocess.run([sys.executable, "-m", "linnet_cli", *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=600, **kw)


def one_line_error(r):
    lines = r.stderr.strip().splitlines()
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    return next(ln for ln in lines if ln.startswith("error:"))


# -- the cache is its owner's alone ----------------------------------------------------------------

def test_a_new_cache_is_private(model, tmp_path):
    root = tmp_path / "fresh" / "linnet"
    compile_model(model, "torch", "float32", 32, cache=ArtifactCache(root))
    for d in (root, root / "artifacts", root / "tmp", root / "locks"):
        assert d.stat().st_mode & 0o777 == 0o700, d


def test_a_cache_others_can_write_is_refused_in_one_line(model, tmp_path):
    root = tmp_path / "shared"
    root.mkdir()
    os.chmod(root, 0o777)
    with pytest.raises(CacheError, match="writable by its group and others"):
        compile_model(model, "torch", "float32", 32, cache=ArtifactCache(root))
    line = one_line_error(cli("compile", model, "--cache-len", "32", cache=root))
    assert "writable by its group and others" in line
    assert not (root / "artifacts").exists()  # nothing was built into it


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="giving a folder away needs root")
def test_a_cache_another_user_owns_is_refused(model, tmp_path):
    root = tmp_path / "theirs"
    root.mkdir(mode=0o755)
    os.chown(root, 4242, 4242)
    with pytest.raises(CacheError, match="belongs to another user"):
        compile_model(model, "torch", "float32", 32, cache=ArtifactCache(root))


def test_an_entry_file_others_can_write_is_refused(model, tmp_path):
    cache = ArtifactCache(tmp_path / "c")
    entry = compile_model(model, "torch", "float32", 32, cache=cache).artifact
    os.chmod(entry / "model.py", 0o666)
    with pytest.raises(CacheError, match="model.py is writable by"):
        load_model(model, "torch", "float32", 32, cache=cache)


def test_files_the_manifest_does_not_list_are_dropped_before_a_load(model, tmp_path):
    """Compiled code added after the manifest (by a session, or by anyone) is never loaded unchecked."""
    cache = ArtifactCache(tmp_path / "c")
    entry = compile_model(model, "torch", "float32", 32, cache=cache).artifact
    planted = entry / "inductor_cache" / "zz" / "planted.so"
    planted.parent.mkdir(parents=True)
    planted.write_bytes(b"\x7fELF not really")
    session, again = load_model(model, "torch", "float32", 32, cache=cache)
    assert again.hit and not planted.exists()
    assert session.prefill([1, 2, 3]).tokens


def test_a_link_inside_an_entry_is_refused(model, tmp_path):
    cache = ArtifactCache(tmp_path / "c")
    entry = compile_model(model, "torch", "float32", 32, cache=cache).artifact
    (entry / "elsewhere").symlink_to(tmp_path)
    with pytest.raises(CacheError, match="symbolic link"):
        compile_model(model, "torch", "float32", 32, cache=cache)


def test_a_changed_compiled_file_is_rebuilt_whatever_its_size(model, tmp_path):
    cache = ArtifactCache(tmp_path / "c")
    entry = compile_model(model, "torch", "float32", 32, cache=cache).artifact
    manifest = json.loads((entry / "manifest.json").read_text())
    assert all("sha256" in m for name, m in manifest["files"].items() if not name.endswith(".safetensors"))
    (entry / "model.py").write_text((entry / "model.py").read_text() + "\n# tampered\n")
    with pytest.warns(Warning, match="damaged"):
        again = compile_model(model, "torch", "float32", 32, cache=cache)
    assert not again.hit and "tampered" not in (again.artifact / "model.py").read_text()


# -- removal never pulls an entry from under its user ------------------------------------------

HOLDER = """
import sys, time
from linnet_core.cache import ArtifactCache
from linnet_core.compile import load_model
session, _ = load_model(sys.argv[1], "torch", "float32", 32, cache=ArtifactCache(sys.argv[2]))
print("loaded", flush=True)
sys.stdin.read()  # hold the session until told to go
print(session.prefill([1, 2, 3]).tokens, flush=True)
"""


def test_rm_and_prune_leave_an_entry_a_process_is_using(model, tmp_path):
    root = tmp_path / "c"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(model), str(root)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "loaded", holder.stderr.read()
        entry = next((root / "artifacts").iterdir())
        r = cli("cache", "rm", "--all", cache=root)
        assert "in use by running processes" in one_line_error(r) and entry.is_dir()
        p = cli("cache", "prune", "--max-size", "1KB", cache=root)
        assert p.returncode == 0 and "in use" in p.stderr and entry.is_dir()
        out, err = holder.communicate("", timeout=120)  # the session still reads its files
        assert holder.returncode == 0 and "[" in out, err
    finally:
        if holder.poll() is None:
            holder.kill()
    assert cli("cache", "rm", "--all", cache=root).returncode == 0 and not entry.exists()


def test_rm_of_an_empty_name_removes_nothing(model, tmp_path):
    root = tmp_path / "c"
    compile_model(model, "torch", "float32", 32, cache=ArtifactCache(root))
    assert "an empty name matches nothing" in one_line_error(cli("cache", "rm", "", cache=root))
    assert len(list((root / "artifacts").iterdir())) == 1


# -- checkpoints, exports, the disk ------------------------------------------------------------

@pytest.mark.parametrize("field,value", [
    ("num_attention_heads", 0), ("num_key_value_heads", -2), ("hidden_size", 0), ("intermediate_size", -5),
    ("num_hidden_layers", 0), ("max_position_embeddings", 0), ("max_position_embeddings", -1), ("head_dim", 0),
    ("vocab_size", 0), ("num_attention_heads", 4.5), ("num_attention_heads", True), ("hidden_size", "64"),
    ("hidden_size", float("inf")), ("hidden_size", float("nan")), ("num_hidden_layers", 10**7),
    ("vocab_size", 2**40),
])
def test_nonsense_sizes_are_refused_by_name(checkpoints, field, value):
    cfg = json.loads((checkpoints[CASE] / "config.json").read_text())
    cfg[field] = value
    with pytest.raises(CheckpointError, match=f"'{field}' must be an integer from 1 to"):
        spec_from_config(cfg)


@pytest.mark.parametrize("field,value", [
    ("rms_norm_eps", float("nan")), ("rms_norm_eps", 0.0), ("rms_norm_eps", "1e-6"), ("rope_theta", float("inf")),
    ("rope_theta", -1.0), ("partial_rotary_factor", 2.0),
])
def test_nonsense_numbers_are_refused_by_name(checkpoints, field, value):
    """A NaN or an infinity never reaches the generated source: refused where the config is read."""
    cfg = json.loads((checkpoints[CASE] / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    cfg[field] = value
    with pytest.raises(CheckpointError, match=f"'{field}' must be a finite number above"):
        spec_from_config(cfg)


def rewrite_header(path, change):
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = change(json.loads(raw[8:8 + n]))
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])


def test_safetensors_headers_with_overlaps_or_odd_metadata_are_refused(model):
    weights = model / "model.safetensors"
    rewrite_header(weights, lambda h: {**h, "__metadata__": ["not", "a", "map"]})
    with pytest.raises(CheckpointError, match="__metadata__ is not a map"):
        read_header(weights)

    def overlap(h):
        h.pop("__metadata__", None)
        names = sorted(h, key=lambda k: h[k]["data_offsets"][0])
        a, b = names[0], names[1]
        size = h[b]["data_offsets"][1] - h[b]["data_offsets"][0]
        h[b]["data_offsets"] = [h[a]["data_offsets"][0], h[a]["data_offsets"][0] + size]
        return h
    rewrite_header(weights, overlap)
    with pytest.raises(CheckpointError, match="overlap"):
        read_header(weights)
    assert "overlap in the file's bytes" in one_line_error(cli("compile", model, "--cache-len", "32",
                                                               cache=model.parent / "c"))


def test_export_force_replaces_only_a_previous_export(model, tmp_path):
    mine = tmp_path / "precious"
    mine.mkdir()
    (mine / "thesis.tex").write_text("years of work")
    with pytest.raises(InputError, match="not a previous Linnet export"):
        from linnet_core.export.hf_export import export_hf
        export_hf(model, mine, force=True, check=False)
    assert (mine / "thesis.tex").read_text() == "years of work"
    out = tmp_path / "hf"
    assert cli("export", "hf", model, out, "--no-check", cache=tmp_path / "c").returncode == 0
    again = cli("export", "hf", model, out, "--no-check", "--force", cache=tmp_path / "c")
    assert again.returncode == 0, again.stderr


def test_a_full_disk_says_so_in_one_line(capsys):
    import typer

    from linnet_cli.output import handle_errors

    @handle_errors
    def write():
        raise OSError(errno.ENOSPC, "No space left on device", "/data/out.gguf")

    with pytest.raises(typer.Exit) as e:
        write()
    err = capsys.readouterr().err
    assert e.value.exit_code == 1 and "no space left on the device of /data/out.gguf" in err
    assert "internal error" not in err


def test_a_tokenizer_that_needs_the_checkpoints_code_is_refused_without_running_it(tmp_path):
    from linnet_core.tokenizer import Tokenizer

    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"auto_map": {"AutoTokenizer": ["tok.T", None]},
                                                               "tokenizer_class": "T"}))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "tokenizer.model").write_bytes(b"not a model")
    (tmp_path / "tok.py").write_text(textwrap.dedent(f"""
        open({str(tmp_path / 'ran')!r}, "w").write("code ran")
    """))
    with pytest.raises(CheckpointError, match="cannot be loaded"):
        Tokenizer(tmp_path)
    assert not (tmp_path / "ran").exists()


CHURN = """
import random, sys, time, traceback
from linnet_core.cache import ArtifactCache
from linnet_core.compile import compile_model, load_model
from linnet_core.errors import CacheError

model, root, seed, seconds = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
rng, cache, counts = random.Random(seed), ArtifactCache(root), {"compile": 0, "load": 0, "prune": 0, "refused": 0}
deadline = time.time() + seconds
try:
    while time.time() < deadline:
        action, n = rng.choice(["compile", "load", "load", "prune"]), rng.choice([32, 48])
        try:
            if action == "compile":
                compile_model(model, "torch", "float32", n, cache=cache)
            elif action == "load":
                session, _ = load_model(model, "torch", "float32", n, cache=cache)
                assert session.prefill([1, 2, 3]).tokens
                del session
            else:
                cache.prune(max_bytes=1)
        except CacheError as e:  # the one-line refusals a user would see, never a traceback
            assert "in use" in e.message or "being removed" in e.message, e.message
            counts["refused"] += 1
        counts[action] += 1
except Exception:
    traceback.print_exc()
    sys.exit(1)
print(counts)
"""


@pytest.mark.slow
def test_four_processes_compiling_loading_and_pruning_the_same_keys(model, tmp_path):
    root = tmp_path / "shared"
    procs = [subprocess.Popen([sys.executable, "-c", CHURN, str(model), str(root), str(i), "60"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(4)]
    outs = [p.communicate(timeout=400) for p in procs]
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0 and "Traceback" not in err, err[-3000:]
    counts = [eval(out.strip().splitlines()[-1]) for out, _ in outs]  # noqa: S307 - our own subprocess's dict
    assert sum(c["load"] for c in counts) > 20 and sum(c["prune"] for c in counts) > 5, counts
    cache = ArtifactCache(root)
    assert all(e.intact for e in cache.entries())  # nothing half-built left behind
    assert list((root / "tmp").iterdir()) == []
    for e in cache.entries():
        assert cache.check(e.path, _key_of(e)) is not None


def _key_of(entry):
    """The ArtifactKey an entry was built for, read back from its manifest (to check it in full)."""
    from linnet_core.cache import ArtifactKey

    m = json.loads((entry.path / "manifest.json").read_text())
    return ArtifactKey(m["model"], m["identity"], m["backend"], m["dtype"], int(m["cache_len"]),
                       tuple(sorted(m["toolchain"].items())))
