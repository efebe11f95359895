"""Qwen3-MoE: Qwen3's attention (per-head q/k norms) with a mixture of experts for every layer's MLP."""

from __future__ import annotations

from ..errors import UnsupportedModel
from .decoder import GgufLayout, hf_llama_style_names, with_experts
from .spec import ModelSpec, common_spec, positive_int, windows_from_max_window_layers

MODEL_TYPE = "qwen3_moe"
ALIASES = ()
HF_ARCHITECTURES = {"qwen3_moe": "Qwen3MoeForCausalLM"}
GGUF = GgufLayout("qwen3moe")


def parse_config(cfg: dict, model_type: str) -> ModelSpec:
    layers = positive_int(cfg, "num_hidden_layers")
    if cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1:
        raise UnsupportedModel("this Qwen3-MoE config mixes dense and expert layers (mlp_only_layers or "
                               "decoder_sparse_step), which Linnet does not model")
    windows = windows_from_max_window_layers(cfg, layers)
    overrides = {"layer_windows": windows} if windows is not None else {}
    # transformers' default for a config without the key: the top-k weights as the softmax gave them
    return common_spec({"norm_topk_prob": False, **cfg}, model_type, MODEL_TYPE, qk_norm=True, **overrides)


def weight_names(spec: ModelSpec) -> dict[str, str]:
    names = hf_llama_style_names(spec, qkv_bias=spec.qkv_bias, o_bias=spec.o_bias, qk_norm=True)
    return with_experts(names, "model.layers.{i}.mlp", "gate_proj", "up_proj", "down_proj", router="gate")
