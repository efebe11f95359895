"""OLMo 2: norms after each branch instead of before it, and q/k norms over the whole projection."""

from __future__ import annotations

from .decoder import GgufLayout, hf_llama_style_names
from .spec import ModelSpec, common_spec

MODEL_TYPE = "olmo2"
ALIASES = ()
HF_ARCHITECTURES = {"olmo2": "Olmo2ForCausalLM"}
GGUF = GgufLayout("olmo2")


def parse_config(cfg: dict, model_type: str) -> ModelSpec:
    return common_spec(cfg, model_type, MODEL_TYPE, qk_norm=True, qk_norm_over="projection")


def weight_names(spec: ModelSpec) -> dict[str, str]:
    names = hf_llama_style_names(spec, qkv_bias=spec.qkv_bias, o_bias=spec.o_bias, qk_norm=True)
    del names["attn_norm.weight"]  # no norm before either branch
    names["post_attention_norm.weight"] = names.pop("ffn_norm.weight")  # Llama's name, here after attention
    names["post_ffw_norm.weight"] = "model.layers.{i}.post_feedforward_layernorm.weight"
    return names
