"""Checkpoints are untrusted: safetensors only, validated headers, clear errors naming file and tensor."""

from __future__ import annotations

import json
import shutil
import struct

import pytest
import torch

from linnet_core.compile import compile_model
from linnet_core.errors import CheckpointError
from linnet_core.weights import Checkpoint, checkpoint_files, read_header, write_safetensors


@pytest.fixture
def copy_of(checkpoints, tmp_path):
    def make(case="llama-gqa-untied"):
        dst = tmp_path / case
        shutil.copytree(checkpoints[case], dst)
        return dst

    return make


def test_sharded_checkpoint_is_read_through_its_index(checkpoints):
    folder = checkpoints["llama-linear-rope-legacy-sharded"]
    files = checkpoint_files(folder)
    assert len(files) > 1 and (folder / "model.safetensors.index.json").is_file()
    ckpt = Checkpoint(files)
    assert "model.layers.1.mlp.down_proj.weight" in ckpt


def test_tensors_are_mapped_not_read(checkpoints):
    ckpt = Checkpoint.from_folder(checkpoints["qwen3-headdim128"])
    a, b = ckpt.get("model.embed_tokens.weight"), ckpt.get("model.norm.weight")
    assert a.shape == (160, 64) and a.dtype == torch.float32
    # Both are views of one mapping of the file: their addresses differ exactly by their file offsets.
    ia, ib = ckpt.info("model.embed_tokens.weight"), ckpt.info("model.norm.weight")
    assert b.data_ptr() - a.data_ptr() == ib.start - ia.start


def test_pickle_checkpoint_is_refused_without_unpickling(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    # A pickle that would run code if loaded: it must never be opened.
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04cos\nsystem\n(S'touch pwned'\ntR.")
    with pytest.raises(CheckpointError, match="pickle checkpoints are never loaded"):
        checkpoint_files(tmp_path)
    assert not (tmp_path / "pwned").exists()


def test_truncated_file_names_file_and_tensor(copy_of):
    folder = copy_of()
    f = folder / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 1000])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor '.*' lies past the end of the file"):
        compile_model(folder, "torch", "float32", 32)


@pytest.mark.parametrize("garbage", [b"", b"\x01\x02", struct.pack("<Q", 1 << 40) + b"{}", struct.pack("<Q", 4) + b"nope"])
def test_corrupt_header_is_a_clear_error(tmp_path, garbage):
    f = tmp_path / "model.safetensors"
    f.write_bytes(garbage)
    with pytest.raises(CheckpointError, match="model.safetensors"):
        read_header(f)


def test_header_shape_that_does_not_match_bytes(tmp_path):
    header = json.dumps({"w": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 8]}}).encode()
    f = tmp_path / "model.safetensors"
    f.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 8)
    with pytest.raises(CheckpointError, match="tensor 'w' has a shape"):
        read_header(f)


def test_missing_tensor_is_named(copy_of):
    folder = copy_of()
    ckpt = Checkpoint.from_folder(folder)
    keep = [(n, ckpt.get(n)) for n in ckpt.tensors if n != "model.layers.1.mlp.up_proj.weight"]
    out = folder / "model.safetensors"
    out.unlink()
    write_safetensors(out, [(n, tuple(t.shape), t.dtype) for n, t in keep], iter([t.clone() for _, t in keep]))
    with pytest.raises(CheckpointError, match="'model.layers.1.mlp.up_proj.weight' is missing"):
        compile_model(folder, "torch", "float32", 32)


def test_shape_that_disagrees_with_config(copy_of):
    folder = copy_of()
    cfg = json.loads((folder / "config.json").read_text())
    cfg["intermediate_size"] = 128
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor 'model\.layers\.0\.mlp\..*' has shape"):
        compile_model(folder, "torch", "float32", 32)


def test_writer_round_trips_every_dtype(tmp_path):
    tensors = {f"t{i}": torch.randn(3, 5).to(dt) for i, dt in enumerate([torch.float32, torch.float16, torch.bfloat16])}
    f = tmp_path / "x.safetensors"
    write_safetensors(f, [(n, tuple(t.shape), t.dtype) for n, t in tensors.items()], iter(tensors.values()))
    ckpt = Checkpoint([f])
    for n, t in tensors.items():
        assert torch.equal(ckpt.get(n), t)
    from safetensors.torch import load_file  # the reference reader agrees

    assert all(torch.equal(load_file(f)[n], t) for n, t in tensors.items())


def test_mappings_ask_for_huge_pages_and_survive_a_kernel_without(checkpoints, monkeypatch):
    import mmap

    from linnet_core import weights

    asked = []

    class NoHugePages:
        def madvise(self, option, *args):
            asked.append(option)
            raise OSError(22, "Invalid argument")

    weights.in_huge_pages(NoHugePages())  # no transparent huge pages: mapped all the same
    assert asked == [mmap.MADV_HUGEPAGE]
    ckpt = Checkpoint(checkpoint_files(checkpoints["llama-gqa-untied"]))
    name = next(iter(ckpt.tensors))
    assert ckpt.get(name).sum().isfinite()


def test_dropping_a_file_from_the_page_cache_keeps_its_bytes(tmp_path):
    from linnet_core.weights import drop_cached

    path = tmp_path / "w.bin"
    path.write_bytes(bytes(range(256)) * 4096)
    drop_cached(path)
    assert path.read_bytes() == bytes(range(256)) * 4096


def _small_page_ranges(path) -> list[tuple[int, int]]:
    """Address ranges of this process's mappings of `path` advised MADV_NOHUGEPAGE ("nh")."""
    import re
    from pathlib import Path

    ranges, current = [], None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) \S+ \S+ \S+ \S+\s+(.*)$", line)
        if head:
            current = (int(head[1], 16), int(head[2], 16)) if head[3] == str(path) else None
        elif current and line.startswith("VmFlags:") and " nh" in line:
            ranges.append(current)
    return ranges


def test_gathered_tables_and_released_weights_are_mapped_in_small_pages(tmp_path):
    """A gathered table, or a norm between repacked matrices, must not fault in 2 MiB per row."""
    import mmap
    import os

    if not os.path.exists("/proc/self/smaps") or not hasattr(mmap, "MADV_NOHUGEPAGE"):
        pytest.skip("no /proc/self/smaps or MADV_NOHUGEPAGE here")
    path = tmp_path / "w.safetensors"
    made = {"a.table": torch.ones(1024, 1024), "b.norm": torch.ones(64), "c.matrix": torch.ones(1024, 1024)}
    write_safetensors(path, [(n, tuple(t.shape), t.dtype) for n, t in made.items()], iter(made.values()))
    ckpt = Checkpoint([path])
    tensors = {name: ckpt.get(name) for name in ckpt.tensors}
    assert _small_page_ranges(path) == []
    ckpt.in_small_pages("a.table")
    ckpt.release("c.matrix")
    ranges = _small_page_ranges(path)
    assert len(ranges) == 2 and all(end - start >= 4 * 1024 * 1024 - 2 * mmap.PAGESIZE for start, end in ranges)
    assert tensors["a.table"].sum() == 1024 * 1024 and tensors["c.matrix"][0, 0] == 1  # still readable
