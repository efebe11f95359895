"""Llama and its kin (Mistral is an alias: same layout, a config that may set `sliding_window`)."""

from __future__ import annotations

from .decoder import GgufLayout, hf_llama_style_names
from .spec import ModelSpec, common_spec

MODEL_TYPE = "llama"
ALIASES = ("mistral",)
HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM"}
# HF checkpoints rotate halves; llama.cpp's llama rotates adjacent pairs.
GGUF = GgufLayout("llama", rope_interleaved=True)


def parse_config(cfg: dict, model_type: str) -> ModelSpec:
    return common_spec(cfg, model_type, MODEL_TYPE)


def weight_names(spec: ModelSpec) -> dict[str, str]:
    return hf_llama_style_names(spec, qkv_bias=spec.qkv_bias, o_bias=spec.o_bias, mlp_bias=spec.mlp_bias)
