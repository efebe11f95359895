"""`linnet export gguf`: every fixture loaded back in llama.cpp (and transformers' GGUF loader)."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest
import torch
from family_fixtures import CASE_IDS
from test_cli import assert_one_line_error, invoke

pytest.importorskip("gguf")

from linnet_core.errors import BackendUnavailable, UnsupportedModel  # noqa: E402
from linnet_core.export import gguf_export  # noqa: E402
from linnet_core.export.gguf_export import export_gguf, permute_for_interleaved_rope  # noqa: E402
from linnet_core.gguf.reader import read_gguf  # noqa: E402
from linnet_core.check.roundtrip import ExportCheckFailed, transformers_gguf_gaps  # noqa: E402
from linnet_core.models import load_spec  # noqa: E402
from linnet_core.weights import Checkpoint  # noqa: E402

HAVE_LLAMA_CPP = importlib.util.find_spec("llama_cpp") is not None
HAVE_HF_GGUF = importlib.util.find_spec("accelerate") is not None
needs_llama_cpp = pytest.mark.skipif(not HAVE_LLAMA_CPP, reason="llama-cpp-python is not installed")
needs_hf_gguf = pytest.mark.skipif(not HAVE_HF_GGUF, reason="accelerate is not installed")


@pytest.fixture(scope="module")
def unchecked(tokenized_checkpoints, tmp_path_factory):
    """Every fixture as an f32 GGUF, written without the check (the reader tests take these)."""
    root = tmp_path_factory.mktemp("gguf")
    return {c: export_gguf(tokenized_checkpoints[c], root / f"{c}.gguf", "f32", check=False).out for c in CASE_IDS}


@needs_llama_cpp
@pytest.mark.parametrize("dtype", ["f32", "f16"])
@pytest.mark.parametrize("case", CASE_IDS)
def test_llama_cpp_round_trip(case, dtype, tokenized_checkpoints, tmp_path):
    r = export_gguf(tokenized_checkpoints[case], tmp_path / "m.gguf", dtype, consumer="llama.cpp").check
    assert r.passed and r.tokenizer_match and r.distance <= r.tolerance
    assert r.consumer.startswith("llama.cpp")
    assert r.greedy_match or dtype == "f16"  # f16 may flip a near tie; f32 may not
    assert r.top1_agreement >= 0.95


@needs_llama_cpp
@pytest.mark.parametrize("case", CASE_IDS)
def test_q8_0_agrees_on_ninety_percent_of_steps(case, tokenized_checkpoints, tmp_path):
    r = export_gguf(tokenized_checkpoints[case], tmp_path / "m.gguf", "q8_0", consumer="llama.cpp").check
    assert r.passed and r.top1_agreement >= 0.9 and r.tolerance is None
    with read_gguf(tmp_path / "m.gguf") as g:
        types = {t.type for t in g.tensors.values()}
    assert "Q8_0" in types and types <= {"Q8_0", "F16", "F32"}


@needs_llama_cpp
@pytest.mark.parametrize("case", ["llama-gqa-untied", "qwen3-headdim128", "phi3-partial-rotary-gqa"])
def test_bf16_round_trip(case, tokenized_checkpoints, tmp_path):
    r = export_gguf(tokenized_checkpoints[case], tmp_path / "m.gguf", "bf16", consumer="llama.cpp").check
    assert r.passed and r.top1_agreement >= 0.9


@needs_hf_gguf
@pytest.mark.parametrize("dtype", ["f32", "f16"])
@pytest.mark.parametrize("case", CASE_IDS)
def test_transformers_round_trip(case, dtype, tokenized_checkpoints, tmp_path):
    src = tokenized_checkpoints[case]
    gaps = transformers_gguf_gaps(load_spec(src))
    if gaps:  # settings its loader drops are refused before anything is written
        with pytest.raises(BackendUnavailable, match="does not read back"):
            export_gguf(src, tmp_path / "m.gguf", dtype, consumer="transformers")
        assert list(tmp_path.iterdir()) == []
        return
    r = export_gguf(src, tmp_path / "m.gguf", dtype, consumer="transformers").check
    assert r.passed and r.distance <= r.tolerance and r.tokenizer_match


def test_transformers_gaps_are_the_known_ones(tokenized_checkpoints):
    gaps = {c: transformers_gguf_gaps(load_spec(tokenized_checkpoints[c])) for c in CASE_IDS}
    assert gaps["llama-llama3-rope"] == ["llama3 rope scaling"]
    assert gaps["phi3-partial-rotary-gqa"] == ["partial rotary"]
    assert gaps["qwen3-legacy-untied"] == ["head_dim 16"]  # its loader keeps Qwen3Config's 128
    assert gaps["qwen3-headdim128"] == gaps["llama-gqa-untied"] == gaps["phi3-fused-window"] == []


@pytest.mark.parametrize("case", CASE_IDS)
def test_tensors_and_keys_read_back(case, unchecked, tokenized_checkpoints):
    """What was written, read by Linnet's own reader: layouts llama.cpp expects, and the metadata."""
    spec = load_spec(tokenized_checkpoints[case])
    ckpt = Checkpoint.from_folder(tokenized_checkpoints[case])
    with read_gguf(unchecked[case]) as g:
        md, arch = g.metadata, g.metadata["general.architecture"]
        assert md[f"{arch}.block_count"] == spec.num_layers
        assert md[f"{arch}.attention.key_length"] == md[f"{arch}.attention.value_length"] == spec.head_dim
        assert md[f"{arch}.rope.dimension_count"] == spec.rotary_dim
        assert len(md["tokenizer.ggml.tokens"]) == spec.vocab_size
        assert md["tokenizer.chat_template"]
        assert ("output.weight" in g.tensors) != spec.tie_word_embeddings
        q = g.tensor("blk.0.attn_q.weight") if "blk.0.attn_q.weight" in g.tensors else None
        if arch == "llama":  # q/k rows permuted to llama.cpp's interleaved rope
            src = ckpt.get("model.layers.0.self_attn.q_proj.weight").float()
            assert np.array_equal(q, permute_for_interleaved_rope(src, spec.num_heads).numpy())
            assert not np.array_equal(q, src.numpy())
        if arch == "phi3":  # fused qkv, and gate/up fused under ffn_up
            assert g.tensors["blk.0.attn_qkv.weight"].shape[0] == (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim
            assert g.tensors["blk.0.ffn_up.weight"].shape[0] == 2 * spec.intermediate_size
            assert "blk.0.ffn_gate.weight" not in g.tensors
        if arch == "qwen3":
            assert "blk.0.attn_q_norm.weight" in g.tensors and "blk.0.attn_k_norm.weight" in g.tensors
        if arch == "qwen2":
            assert "blk.0.attn_q.bias" in g.tensors
        if arch == "granite":  # the config's multipliers, under llama.cpp's keys
            assert md["granite.embedding_scale"] == 4.0 and md["granite.residual_scale"] == 0.5
            assert md["granite.attention.scale"] == pytest.approx(0.3) and md["granite.logit_scale"] == 2.0
        if arch == "olmo2":  # norms after each branch only; q/k norms over the whole projection
            assert "blk.0.attn_norm.weight" not in g.tensors and "blk.0.ffn_norm.weight" not in g.tensors
            assert g.tensors["blk.0.post_ffw_norm.weight"].shape == (spec.hidden_size,)
            assert g.tensors["blk.0.attn_q_norm.weight"].shape == (spec.num_heads * spec.head_dim,)
        if spec.rope.type == "llama3":
            factors = g.tensor("rope_freqs.weight")
            assert factors.shape == (spec.rotary_dim // 2,) and factors.max() == pytest.approx(spec.rope.factor)
        if spec.rope.type == "linear":
            assert md[f"{arch}.rope.scaling.type"] == "linear"
            assert md[f"{arch}.rope.scaling.factor"] == pytest.approx(spec.rope.factor)
        if any(spec.layer_windows):  # the smallest window, unless llama.cpp slides the layers itself (Gemma)
            fixed = arch in ("gemma2", "gemma3")
            assert md[f"{arch}.context_length"] == (spec.max_position_embeddings if fixed else
                                                    min(w for w in spec.layer_windows if w))
            assert md[f"{arch}.attention.sliding_window"] == 8 or not fixed
        style = md["tokenizer.ggml.model"]
        if style == "gpt2":
            assert md["tokenizer.ggml.pre"] in ("qwen2", "llama-bpe") and len(md["tokenizer.ggml.merges"]) > 10
            assert md["tokenizer.ggml.tokens"][-1].startswith("[PAD")  # the model's padded vocabulary
        else:
            assert style == "llama" and md["tokenizer.ggml.add_space_prefix"] is True
            assert md["tokenizer.ggml.token_type"][3] == 6  # <0x00> is a byte token
            assert md["tokenizer.ggml.bos_token_id"] == 1 and md["tokenizer.ggml.eos_token_id"] == 2


def test_nope_layers_llama_cpp_cannot_place_are_refused(tmp_path):
    """llama.cpp's smollm3 skips rope on every 4th layer whatever the file says: another pattern is
    refused in one line, and nothing is written."""
    from family_fixtures import CASES, TOKENIZED_VOCAB, make_checkpoint
    from tokenizer_fixtures import write_tokenizer

    case = next(c for c in CASES if c.id == "smollm3-nope")
    src = make_checkpoint(case, tmp_path / "src", vocab_size=TOKENIZED_VOCAB, no_rope_layers=[1, 0, 1, 1])
    write_tokenizer(src, case.tokenizer, TOKENIZED_VOCAB)
    with pytest.raises(UnsupportedModel, match=r"leaves rope out of layers \[3\]; this model leaves it out of \[1\]"):
        export_gguf(src, tmp_path / "out" / "m.gguf", "f32", check=False)
    assert not (tmp_path / "out").exists() or list((tmp_path / "out").iterdir()) == []


def test_what_llama_cpp_fixes_for_an_architecture_must_match():
    """llama.cpp derives Gemma's query scale from the head width and fixes its sliding pattern and the
    sliding layers' rope base: a config that differs is refused before a file is written."""
    from linnet_core.export.gguf_export import check_spellable
    from linnet_core.models import spec_from_config

    base = {"hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "vocab_size": 100, "sliding_window": 8, "query_pre_attn_scalar": 16}
    check_spellable(spec_from_config({**base, "model_type": "gemma2", "num_hidden_layers": 4}))
    check_spellable(spec_from_config({**base, "model_type": "gemma3_text", "num_hidden_layers": 6}))
    refused = {"an attention scale of 0.0625": {"model_type": "gemma2", "num_hidden_layers": 4,
                                                "query_pre_attn_scalar": 256},
               "not llama.cpp's fixed pattern": {"model_type": "gemma3_text", "num_hidden_layers": 6,
                                                 "sliding_window_pattern": 2},
               "sliding layers' rope": {"model_type": "gemma3_text", "num_hidden_layers": 6,
                                        "rope_local_base_freq": 5000.0}}
    for message, cfg in refused.items():
        with pytest.raises(UnsupportedModel, match=message):
            check_spellable(spec_from_config({**base, **cfg}))


def test_every_dtype_decodes_close_to_the_source(tokenized_checkpoints, tmp_path):
    src = tokenized_checkpoints["qwen3-headdim128"]
    w = Checkpoint.from_folder(src).get("model.layers.0.mlp.down_proj.weight").float().numpy()
    limits = {"f32": 0, "f16": 1e-3, "bf16": 8e-3, "q8_0": np.abs(w).max() / 127 / 2 + 1e-6}
    for dtype, limit in limits.items():
        path = export_gguf(src, tmp_path / f"{dtype}.gguf", dtype, check=False).out
        with read_gguf(path) as g:
            got = g.tensor("blk.0.ffn_down.weight")
            assert np.abs(got - w).max() <= limit, dtype
            assert g.tensors["blk.0.attn_norm.weight"].type == "F32"  # norms stay f32


def test_phi3_name_that_would_make_llama_cpp_demand_missing_tokens(tokenized_checkpoints, tmp_path):
    import shutil

    src = tmp_path / "Phi-3-tiny"
    shutil.copytree(tokenized_checkpoints["phi3-fused-window"], src)
    with read_gguf(export_gguf(src, tmp_path / "a.gguf", check=False).out) as g:
        assert "general.name" not in g.metadata  # its vocabulary lacks <|end|>
    with read_gguf(export_gguf(tokenized_checkpoints["llama-gqa-untied"], tmp_path / "b.gguf", check=False).out) as g:
        assert g.metadata["general.name"] == "llama-gqa-untied"


@pytest.fixture
def phi3_byte_level(tmp_path):
    """A Phi-3 named as such, whose tokenizer is byte-level BPE with <|end|> but no <s>, </s>, <unk>."""
    from family_fixtures import CASES, TOKENIZED_VOCAB, make_checkpoint
    from tokenizer_fixtures import write_tokenizer

    case = next(c for c in CASES if c.id == "phi3-fused-window")
    folder = make_checkpoint(case, tmp_path / "Phi-3-mini-bpe", vocab_size=TOKENIZED_VOCAB)
    write_tokenizer(folder, "phi-bpe", TOKENIZED_VOCAB)
    return folder


@needs_llama_cpp
def test_phi3_with_a_byte_level_vocabulary_loads_in_llama_cpp(phi3_byte_level, tmp_path):
    """llama.cpp looks four tokens up by text when general.name says phi3 ("unordered_map::at" when one
    is missing): the name is left out, the file loads and matches its source."""
    result = export_gguf(phi3_byte_level, tmp_path / "m.gguf", "f32", consumer="llama.cpp")
    assert result.check.passed and result.check.tokenizer_match
    with read_gguf(result.out) as g:
        assert "general.name" not in g.metadata and g.metadata["tokenizer.ggml.model"] == "gpt2"


@needs_llama_cpp
def test_a_file_llama_cpp_refuses_names_its_reason_and_is_not_written(phi3_byte_level, tmp_path, monkeypatch):
    """The exception llama-cpp-python raises says only "Failed to load model"; the export's error
    carries llama.cpp's own reason from its log, and no hint about dtypes."""
    from dataclasses import replace

    real = gguf_export.gguf_layout
    monkeypatch.setattr(gguf_export, "gguf_layout",  # the name check as it was: <|end|> only
                        lambda spec: replace(real(spec), name_needs_tokens=(("phi3",), ("<|end|>",))))
    with pytest.raises(ExportCheckFailed) as failed:
        export_gguf(phi3_byte_level, tmp_path / "m.gguf", "f32", consumer="llama.cpp")
    assert "unordered_map::at" in failed.value.message and "nothing was written" in failed.value.message
    assert "dtype" not in failed.value.hint
    assert [p.name for p in tmp_path.iterdir()] == [phi3_byte_level.name]  # the source alone, no file, no temp


@needs_llama_cpp
def test_a_wrong_layout_is_caught_and_not_written(tokenized_checkpoints, tmp_path, monkeypatch):
    monkeypatch.setattr(gguf_export, "permute_for_interleaved_rope", lambda w, heads: w)  # forget the permutation
    with pytest.raises(ExportCheckFailed, match="was not written"):
        export_gguf(tokenized_checkpoints["llama-gqa-untied"], tmp_path / "m.gguf", "f32", consumer="llama.cpp")
    assert list(tmp_path.iterdir()) == []


def test_interrupted_export_leaves_nothing(tokenized_checkpoints, tmp_path, monkeypatch):
    real = gguf_export._tensor

    def interrupting(name, *args):
        t = real(name, *args)
        if name == "blk.1.attn_q.weight":
            def boom():
                raise KeyboardInterrupt
            t.make = boom
        return t

    monkeypatch.setattr(gguf_export, "_tensor", interrupting)
    with pytest.raises(KeyboardInterrupt):
        export_gguf(tokenized_checkpoints["llama-gqa-untied"], tmp_path / "m.gguf", check=False)
    assert list(tmp_path.iterdir()) == []


def test_cli_summary_json_and_errors(tokenized_checkpoints, checkpoints, tmp_path):
    src, out = tokenized_checkpoints["qwen2-bias-tied"], tmp_path / "q.gguf"
    r = invoke("export", "gguf", src, out, "--dtype", "f16", "--json", *(["--no-check"] * (not HAVE_LLAMA_CPP and
                                                                                      not HAVE_HF_GGUF)))
    assert r.exit_code == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["format"] == "gguf" and data["files"] == {"q.gguf": out.stat().st_size}
    assert data["check"] is None or data["check"]["passed"]
    assert_one_line_error(invoke("export", "gguf", src, out), 1, "already exists")
    assert_one_line_error(invoke("export", "gguf", src, tmp_path / "x.gguf", "--dtype", "q4_k"), 2, "q4_k")
    assert_one_line_error(invoke("export", "gguf", src, tmp_path / "x.gguf", "--check-with", "vllm"), 2, "vllm")
    # The core fixtures ship no tokenizer, and a GGUF must carry one.
    assert_one_line_error(invoke("export", "gguf", checkpoints["qwen2-bias-tied"], tmp_path / "y.gguf", "--no-check"),
                          1, "no tokenizer.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q.gguf"]


def test_unknown_pre_tokenizer_is_refused(tokenized_checkpoints, tmp_path):
    import shutil

    src = tmp_path / "m"
    shutil.copytree(tokenized_checkpoints["qwen2-bias-tied"], src)
    tj = json.loads((src / "tokenizer.json").read_text())
    tj["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = r"\w+|\s+"
    (src / "tokenizer.json").write_text(json.dumps(tj))
    with pytest.raises(UnsupportedModel, match="pre-tokenizer"):
        export_gguf(src, tmp_path / "m.gguf", check=False)
    assert not (tmp_path / "m.gguf").exists()


def test_rope_freq_factors_match_the_ir_rope(tokenized_checkpoints):
    spec = load_spec(tokenized_checkpoints["llama-llama3-rope"])
    factors = gguf_export.rope_freq_factors(spec)
    assert factors.min() == pytest.approx(1.0) and factors.max() == pytest.approx(spec.rope.factor)
    assert torch.all(torch.from_numpy(np.diff(factors)) >= 0)  # low frequencies are scaled the most


def test_a_pad_id_is_written_when_the_checkpoint_has_none(tokenized_checkpoints, tmp_path):
    """transformers' GGUF loader otherwise takes its config class's default pad id (Phi-3: 32000),
    outside a smaller vocabulary, and the embedding cannot be built."""
    import shutil

    src = tmp_path / "phi3"
    shutil.copytree(tokenized_checkpoints["phi3-fused-window"], src)
    for name in ("config.json", "generation_config.json"):
        cfg = json.loads((src / name).read_text())
        cfg.pop("pad_token_id", None)
        (src / name).write_text(json.dumps(cfg))
    with read_gguf(export_gguf(src, tmp_path / "m.gguf", check=False).out) as g:
        assert g.metadata["tokenizer.ggml.padding_token_id"] == g.metadata["tokenizer.ggml.eos_token_id"] == 2
    # The source itself is what transformers cannot load here: one line, not a traceback.
    assert_one_line_error(invoke("export", "gguf", src, tmp_path / "n.gguf", "--check-with", "transformers"), 1,
                          "cannot load")


def test_lossy_agreement_counts_only_positions_the_reference_decides():
    """Near-ties in the reference (random weights have many) cannot fail a lossy export's check."""
    import numpy as np

    from linnet_core.check.agreement import decisive_agreement

    ref = np.array([[5.0, 0.0, 0.0], [1.0, 1.001, 0.0], [0.0, 0.0, 4.0]])  # the middle row is a tie
    got = np.array([[4.9, 0.1, 0.0], [1.01, 1.0, 0.0], [0.0, 0.1, 3.9]])  # disagrees only on the tie
    assert decisive_agreement(got, ref, "bfloat16") == 1.0
    wrong = got.copy()
    wrong[0] = [0.0, 5.0, 0.0]  # a decisive position lost
    assert decisive_agreement(wrong, ref, "bfloat16") == 0.5
    flat = np.zeros((2, 3))
    assert decisive_agreement(flat, flat, "bfloat16") == 1.0  # nothing stands out: all positions count
