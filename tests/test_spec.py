"""Config reading: both config styles, every family, and refusals by name."""

from __future__ import annotations

import json

import pytest
from family_fixtures import CASES, to_legacy

from linnet_core.errors import CheckpointError, UnsupportedModel
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


def test_new_families_features_are_read(checkpoints):
    granite = load_spec(checkpoints["granite-multipliers"])
    assert (granite.embedding_scale, granite.residual_scale, granite.attention_scale, granite.logit_scale) == \
        (4.0, 0.5, 0.3, 0.5)
    olmo2 = load_spec(checkpoints["olmo2-post-norms"])
    assert olmo2.qk_norm and olmo2.qk_norm_over == "projection"
    assert load_spec(checkpoints["smollm3-nope"]).no_rope_layers == (3,)
    gemma2 = load_spec(checkpoints["gemma2-softcaps"])
    assert (gemma2.attention_softcap, gemma2.logit_softcap, gemma2.norm_weight_offset) == (3.0, 4.0, 1.0)
    assert gemma2.layer_windows == (8, None) and gemma2.hidden_act == "gelu_pytorch_tanh"
    gemma3 = load_spec(checkpoints["gemma3-local-global"])
    assert gemma3.layer_windows == (8,) * 5 + (None,)
    assert (gemma3.rope.type, gemma3.rope.theta, gemma3.rope.factor) == ("linear", 1e6, 8.0)
    assert (gemma3.sliding_rope.type, gemma3.sliding_rope.theta) == ("default", 1e4)


GEMMA = {"hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 16, "vocab_size": 100, "sliding_window": 8}


def test_gemma_configs_before_layer_types_slide_by_their_pattern():
    """transformers 4's Gemma 2 slid even layers; Gemma 3 all but each `sliding_window_pattern`-th, with
    the sliding layers' rope base in `rope_local_base_freq`."""
    g2 = spec_from_config({**GEMMA, "model_type": "gemma2", "num_hidden_layers": 4, "query_pre_attn_scalar": 256})
    assert g2.layer_windows == (8, None, 8, None) and g2.attention_scale == 256 ** -0.5 and g2.tie_word_embeddings
    g3 = spec_from_config({**GEMMA, "model_type": "gemma3_text", "num_hidden_layers": 4, "sliding_window_pattern": 2,
                           "rope_theta": 1e6, "rope_local_base_freq": 5e3, "rope_scaling": {"rope_type": "linear",
                                                                                             "factor": 8.0}})
    assert g3.layer_windows == (8, None, 8, None)
    assert (g3.rope.theta, g3.rope.type, g3.sliding_rope.theta, g3.sliding_rope.type) == (1e6, "linear", 5e3, "default")


def test_smollm3_no_rope_layers_are_checked():
    cfg = {**GEMMA, "model_type": "smollm3", "num_hidden_layers": 4}
    assert spec_from_config(cfg).no_rope_layers == (3,)  # every 4th, as transformers' default interval
    assert spec_from_config({**cfg, "no_rope_layer_interval": 2}).no_rope_layers == (1, 3)
    assert spec_from_config({**cfg, "no_rope_layers": [0, 1, 1, 1]}).no_rope_layers == (0,)
    with pytest.raises(CheckpointError, match="'no_rope_layers' must list 0 or 1 for each of the 4 layers"):
        spec_from_config({**cfg, "no_rope_layers": [1, 1]})


# The published configs (their fields that Linnet reads, verbatim), as downloaded checkpoints carry them.
GEMMA3_1B = {"architectures": ["Gemma3ForCausalLM"], "attn_logit_softcapping": None, "bos_token_id": 2,
             "eos_token_id": [1, 106], "final_logit_softcapping": None, "head_dim": 256,
             "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152, "intermediate_size": 6912,
             "max_position_embeddings": 32768, "model_type": "gemma3_text", "num_attention_heads": 4,
             "num_hidden_layers": 26, "num_key_value_heads": 1, "pad_token_id": 0, "query_pre_attn_scalar": 256,
             "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000, "rope_scaling": None, "rope_theta": 1000000,
             "sliding_window": 512, "sliding_window_pattern": 6, "torch_dtype": "bfloat16", "vocab_size": 262144}
GEMMA2_2B = {"architectures": ["Gemma2ForCausalLM"], "attn_logit_softcapping": 50.0, "bos_token_id": 2,
             "eos_token_id": [1, 107], "final_logit_softcapping": 30.0, "head_dim": 256, "hidden_act": "gelu_pytorch_tanh",
             "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 2304, "intermediate_size": 9216,
             "max_position_embeddings": 8192, "model_type": "gemma2", "num_attention_heads": 8, "num_hidden_layers": 26,
             "num_key_value_heads": 4, "pad_token_id": 0, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06,
             "rope_theta": 10000.0, "sliding_window": 4096, "torch_dtype": "float32", "vocab_size": 256000}
GRANITE_2B = {"architectures": ["GraniteForCausalLM"], "attention_bias": False, "attention_multiplier": 0.015625,
              "embedding_multiplier": 12.0, "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 8192,
              "logits_scaling": 8.0, "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "granite",
              "num_attention_heads": 32, "num_hidden_layers": 40, "num_key_value_heads": 8, "residual_multiplier": 0.22,
              "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 10000000.0, "tie_word_embeddings": True,
              "torch_dtype": "bfloat16", "vocab_size": 49159}


QWEN3_30B_A3B = {"architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "bos_token_id": 151643,
                 "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
                 "hidden_size": 2048, "intermediate_size": 6144, "max_position_embeddings": 40960,
                 "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 768,
                 "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8,
                 "num_hidden_layers": 48, "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_scaling": None,
                 "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": False,
                 "torch_dtype": "bfloat16", "use_sliding_window": False, "vocab_size": 151936}
MIXTRAL_8X7B = {"architectures": ["MixtralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
                "hidden_size": 4096, "intermediate_size": 14336, "max_position_embeddings": 32768, "model_type": "mixtral",
                "num_attention_heads": 32, "num_experts_per_tok": 2, "num_hidden_layers": 32, "num_key_value_heads": 8,
                "num_local_experts": 8, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "sliding_window": None,
                "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 32000}


@pytest.mark.parametrize("config,experts,top_k,width,total,active", [
    (QWEN3_30B_A3B, 128, 8, 768, 30.5e9, 3.3e9), (MIXTRAL_8X7B, 8, 2, 14336, 46.7e9, 12.9e9)])
def test_published_mixtures_of_experts_are_read(config, experts, top_k, width, total, active):
    """Both spellings of the expert count; the graph's parameters, all and read per token, as the model
    cards give them (from the shapes alone)."""
    import math

    from linnet_core.models import build_graph
    from linnet_core.params import read_shares

    spec = spec_from_config(config)
    assert (spec.num_experts, spec.experts_per_token, spec.expert_intermediate_size) == (experts, top_k, width)
    assert spec.normalize_expert_weights and spec.layer_windows == (None,) * spec.num_layers
    graph = build_graph(spec)
    shares = read_shares(graph)
    every = sum(math.prod(p.shape) for _, p, _ in graph.all_params())
    read = sum(math.prod(p.shape) * shares[full] for full, p, _ in graph.all_params())
    assert abs(every - total) / total < 0.01 and abs(read - active) / active < 0.03, (every, read)


def test_a_mixture_of_dense_and_expert_layers_is_refused_in_one_line():
    with pytest.raises(UnsupportedModel, match="mixes dense and expert layers"):
        spec_from_config({**QWEN3_30B_A3B, "mlp_only_layers": [0, 1]})


def test_published_configs_of_the_new_families_are_read():
    g3 = spec_from_config(GEMMA3_1B)
    assert g3.layer_windows == ((512,) * 5 + (None,)) * 4 + (512,) * 2  # 26 layers: 5 sliding to each full one
    assert (g3.rope.theta, g3.sliding_rope.theta, g3.attention_scale, g3.embedding_scale) == \
        (1e6, 1e4, 256 ** -0.5, 1152 ** 0.5)
    assert g3.tie_word_embeddings and g3.qk_norm and g3.eos_token_ids == (1, 106)
    g2 = spec_from_config(GEMMA2_2B)
    assert g2.layer_windows[:4] == (4096, None, 4096, None) and g2.sliding_rope is None
    assert (g2.attention_softcap, g2.logit_softcap, g2.norm_weight_offset) == (50.0, 30.0, 1.0)
    granite = spec_from_config(GRANITE_2B)
    assert (granite.embedding_scale, granite.residual_scale, granite.attention_scale, granite.logit_scale) == \
        (12.0, 0.22, 0.015625, 0.125)


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
