"""Llama and its kin (Mistral is an alias: same layout, a config that may set `sliding_window`; Mixtral
is Mistral with a mixture of experts for its MLP)."""

from __future__ import annotations

from .decoder import GgufLayout, hf_llama_style_names, with_experts
from .spec import ModelSpec, common_spec

MODEL_TYPE = "llama"
ALIASES = ("mistral", "mixtral")
HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "mixtral": "MixtralForCausalLM"}
# HF checkpoints rotate halves; llama.cpp's llama rotates adjacent pairs.
GGUF = GgufLayout("llama", rope_interleaved=True, moe_model_type="mixtral")


def parse_config(cfg: dict, model_type: str) -> ModelSpec:
    return common_spec(cfg, model_type, MODEL_TYPE)


def weight_names(spec: ModelSpec) -> dict[str, str]:
    names = hf_llama_style_names(spec, qkv_bias=spec.qkv_bias, o_bias=spec.o_bias, mlp_bias=spec.mlp_bias)
    if spec.num_experts:  # Mixtral's names: w1 the gate, w3 the up, w2 the down projection
        return with_experts(names, "model.layers.{i}.block_sparse_moe", "w1", "w3", "w2", router="gate")
    return names
