"""`linnet export hf`: every fixture loaded back in transformers, logits and tokenizer compared."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from family_fixtures import CASE_IDS
from test_cli import assert_one_line_error, invoke

from linnet_core.export import hf_export
from linnet_core.export.hf_export import export_hf
from linnet_core.check.roundtrip import SAMPLE_TEXT, ExportCheckFailed
from linnet_core.models import load_spec, spec_from_config
from linnet_core.units import parse_size
from linnet_core.weights import Checkpoint

IDS = [5, 17, 42, 99, 123, 200, 7, 64, 301, 33, 12, 250]


def transformers_logits(folder, ids=IDS) -> np.ndarray:
    """The last-layer logits transformers computes for `ids`, independent of Linnet's check code."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, attn_implementation="eager").eval()
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].numpy()


def encode(folder, text=SAMPLE_TEXT) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder)).encode(text)


@pytest.fixture(scope="module")
def exported(tokenized_checkpoints, tmp_path_factory):
    """Each fixture exported once (float32, checked), shared by the tests below."""
    root = tmp_path_factory.mktemp("hf-exports")
    return {case: export_hf(tokenized_checkpoints[case], root / case) for case in CASE_IDS}


@pytest.mark.parametrize("case", CASE_IDS)
def test_round_trip_in_transformers(case, exported, tokenized_checkpoints):
    result = exported[case]
    assert result.check.passed and result.check.distance <= 1e-5 and result.check.tokenizer_match
    assert result.check.greedy_match and result.check.top1_agreement == 1.0
    # Independently of the check's own code: same logits, same token ids, chat template kept.
    distance = np.abs(transformers_logits(result.out) - transformers_logits(tokenized_checkpoints[case])).max()
    assert distance <= 1e-5
    assert encode(result.out) == encode(tokenized_checkpoints[case])
    src_cfg = json.loads((tokenized_checkpoints[case] / "tokenizer_config.json").read_text())
    assert json.loads((result.out / "tokenizer_config.json").read_text())["chat_template"] == src_cfg["chat_template"]


@pytest.mark.parametrize("case", CASE_IDS)
def test_config_reads_the_same_in_both_styles(case, exported, tokenized_checkpoints):
    cfg = json.loads((exported[case].out / "config.json").read_text())
    # What transformers 5 reads ...
    v5 = {k: v for k, v in cfg.items() if k not in ("rope_theta", "rope_scaling", "torch_dtype", "partial_rotary_factor")}
    # ... and what the vLLM / SGLang / TGI releases in use read.
    legacy = {k: v for k, v in cfg.items() if k not in ("rope_parameters", "dtype")}
    source = load_spec(tokenized_checkpoints[case])
    assert spec_from_config(v5) == spec_from_config(legacy) == source
    assert cfg["torch_dtype"] == cfg["dtype"] == "float32" and cfg["architectures"][0].endswith("ForCausalLM")
    assert isinstance(cfg["rope_theta"], float)
    if source.rope.type != "default":
        assert cfg["rope_scaling"]["type"] == cfg["rope_scaling"]["rope_type"] == source.rope.type
        assert cfg["rope_scaling"]["factor"] == source.rope.factor
    else:
        assert cfg["rope_scaling"] is None
    gen = json.loads((exported[case].out / "generation_config.json").read_text())
    assert gen.get("eos_token_id") is not None


def test_files_shards_and_index(tokenized_checkpoints, tmp_path):
    src = tokenized_checkpoints["llama-gqa-untied"]
    result = export_hf(src, tmp_path / "out", max_shard_size="100KB")
    index = json.loads((result.out / "model.safetensors.index.json").read_text())
    shards = sorted(p for p in result.out.glob("model-*.safetensors"))
    assert len(shards) > 3 and shards[0].name == f"model-00001-of-{len(shards):05d}.safetensors"
    ckpt = Checkpoint(shards)
    assert set(index["weight_map"]) == set(ckpt.tensors) == set(Checkpoint.from_folder(src).tensors)
    assert index["metadata"]["total_size"] == sum(i.nbytes for i in ckpt.tensors.values())
    biggest = max(i.nbytes for i in ckpt.tensors.values())
    assert all(p.stat().st_size <= max(100_000, biggest) + 4096 for p in shards)  # + the header
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= set(result.files)
    assert result.check.passed


def test_tied_head_is_stored_once(exported):
    out = exported["qwen2-bias-tied"].out
    assert "lm_head.weight" not in Checkpoint.from_folder(out).tensors
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True


def test_bfloat16_export(tokenized_checkpoints, tmp_path):
    result = export_hf(tokenized_checkpoints["qwen3-headdim128"], tmp_path / "bf16", dtype="bf16")
    ckpt = Checkpoint.from_folder(result.out)
    assert {i.dtype for i in ckpt.tensors.values()} == {torch.bfloat16}
    assert json.loads((result.out / "config.json").read_text())["dtype"] == "bfloat16"
    assert result.check.passed and result.check.tolerance is None and result.check.top1_agreement >= 0.9


def test_existing_out_is_refused_and_force_replaces(tokenized_checkpoints, tmp_path):
    src, out = tokenized_checkpoints["phi3-fused-window"], tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    r = invoke("export", "hf", src, out)
    assert_one_line_error(r, 1, "already exists")
    assert (out / "keep.txt").read_text() == "mine"
    r = invoke("export", "hf", src, out, "--force")  # not an earlier export: someone's work, kept
    assert_one_line_error(r, 1, "not a previous Linnet export")
    assert (out / "keep.txt").read_text() == "mine"
    (out / ".linnet-export").write_text("")  # as an earlier export leaves it
    r = invoke("export", "hf", src, out, "--force", "--json")
    assert r.exit_code == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["check"]["passed"] and data["format"] == "hf" and not (out / "keep.txt").exists()
    assert list(tmp_path.iterdir()) == [out]  # no temporary folder left beside it


def test_interrupted_export_leaves_nothing(tokenized_checkpoints, tmp_path, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(hf_export, "write_safetensors", interrupted)
    with pytest.raises(KeyboardInterrupt):
        export_hf(tokenized_checkpoints["llama-gqa-untied"], tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_an_export_that_computes_something_else_is_not_written(tokenized_checkpoints, tmp_path, monkeypatch):
    real = hf_export.hf_config

    def wrong_theta(source, spec, dtype):  # a config mistake that still loads
        cfg = real(source, spec, dtype)
        cfg["rope_parameters"]["rope_theta"] = cfg["rope_theta"] = 77.0
        return cfg

    monkeypatch.setattr(hf_export, "hf_config", wrong_theta)
    with pytest.raises(ExportCheckFailed, match="was not written"):
        export_hf(tokenized_checkpoints["llama-gqa-untied"], tmp_path / "out")
    assert list(tmp_path.iterdir()) == []
    r = invoke("export", "hf", tokenized_checkpoints["llama-gqa-untied"], tmp_path / "out")
    assert_one_line_error(r, 3, "FAILED")
    assert "--no-check" in r.stderr


def test_python_api_and_no_check(tokenized_checkpoints, tmp_path):
    from linnet_core import export_hf as api

    result = api(tokenized_checkpoints["mistral-window"], tmp_path / "x", check=False)
    assert result.check is None and (tmp_path / "x" / "config.json").is_file()


@pytest.mark.parametrize("text,expected", [("5GB", 5 * 10**9), ("500MB", 500 * 10**6), ("2GiB", 2 * 2**30),
                                           ("1234", 1234), ("1.5kB", 1500)])
def test_shard_sizes(text, expected):
    assert parse_size(text) == expected


def test_bad_shard_size_is_one_line(tokenized_checkpoints, tmp_path):
    r = invoke("export", "hf", tokenized_checkpoints["llama-gqa-untied"], tmp_path / "o", "--max-shard-size", "lots")
    assert_one_line_error(r, 1, "cannot read 'lots' as a size")
