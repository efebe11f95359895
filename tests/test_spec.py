"""Config reading: both config styles, every family, and refusals by name."""

from __future__ import annotations

import json

import pytest
from family_fixtures import CASES, to_legacy

from linnet_core.errors import UnsupportedModel
from linnet_core.models import MODEL_TYPES, load_spec, spec_from_config


def test_legacy_and_v5_configs_read_the_same(checkpoints):
    for case in CASES:
        cfg = json.loads((checkpoints[case.id] / "config.json").read_text())
        other = cfg if case.legacy else to_legacy(cfg)
        assert spec_from_config(cfg) == spec_from_config(other), case.id


def test_features_are_read(checkpoints):
    qwen3 = load_spec(checkpoints["qwen3-headdim128"])
    assert (qwen3.head_dim, qwen3.hidden_size // qwen3.num_heads, qwen3.qk_norm) == (128, 16, True)
    assert qwen3.tie_word_embeddings
    llama3 = load_spec(checkpoints["llama-llama3-rope"])
    assert (llama3.rope.type, llama3.rope.factor, llama3.rope.original_max_position_embeddings) == ("llama3", 8.0, 32)
    linear = load_spec(checkpoints["llama-linear-rope-legacy-sharded"])
    assert (linear.rope.type, linear.rope.factor, linear.num_kv_heads) == ("linear", 2.0, 1)
    assert load_spec(checkpoints["mistral-window"]).layer_windows == (8, 8)
    assert load_spec(checkpoints["mistral-window"]).model_type == "mistral"
    assert load_spec(checkpoints["mistral-window"]).family == "llama"
    phi = load_spec(checkpoints["phi3-partial-rotary-gqa"])
    assert (phi.rotary_dim, phi.head_dim) == (8, 16)
    assert load_spec(checkpoints["qwen2-bias-tied"]).qkv_bias
    assert not load_spec(checkpoints["qwen2-bias-tied"]).o_bias
    assert load_spec(checkpoints["llama-mha-tied-legacy"]).num_kv_heads == 4


def test_phi3_mini_config_sets_its_window():
    cfg = {"model_type": "phi3", "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 32,
           "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32064, "rope_theta": 10000.0,
           "rope_scaling": None, "sliding_window": 2047, "max_position_embeddings": 4096, "torch_dtype": "bfloat16"}
    spec = spec_from_config(cfg)
    assert spec.layer_windows == (2047,) * 32 and spec.dtype == "bfloat16"


def test_qwen2_legacy_window_follows_max_window_layers():
    cfg = {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
           "num_attention_heads": 4, "vocab_size": 100, "use_sliding_window": True, "sliding_window": 16,
           "max_window_layers": 2}
    assert spec_from_config(cfg).layer_windows == (None, None, 16, 16)
    cfg["use_sliding_window"] = False
    assert spec_from_config(cfg).layer_windows == (None,) * 4


def test_unsupported_model_type_is_refused_by_name():
    with pytest.raises(UnsupportedModel) as e:
        spec_from_config({"model_type": "gpt2", "hidden_size": 8})
    assert "gpt2" in str(e.value)
    for name in MODEL_TYPES:
        assert name in str(e.value)


@pytest.mark.parametrize("style", ["rope_parameters", "rope_scaling"])
def test_unsupported_rope_type_is_refused_by_name(style):
    cfg = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
           "num_attention_heads": 4, "vocab_size": 100}
    cfg[style] = {"rope_type" if style == "rope_parameters" else "type": "yarn", "factor": 4.0, "rope_theta": 1e4}
    with pytest.raises(UnsupportedModel, match="yarn.*supported: default, linear, llama3"):
        spec_from_config(cfg)
